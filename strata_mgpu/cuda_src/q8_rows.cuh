// Rows of GGML blocks dotted with several quantized vectors at once: the integer inner loop of the
// kernels that multiply rows of x by weights as the file stores them (dense_decode.cu's dense_q8,
// moe_grouped.cu's experts, and moe_decode.cu's with one vector). One warp; lane l takes sub-blocks l, l + 32, ... of each row, unpacks
// each once (q8_unpack) and dots it with every vector (Q8Sub::dot), so a weight is read and
// unpacked once however many vectors there are, and each vector's words are loaded once for all
// R rows. Each sum runs over a lane's sub-blocks in turn, then the warp's sum, whatever R and N:
// so the grouped kernels equal decode's pick-by-pick ones bit for bit.
#pragma once
#include "q8_dot.cuh"
#include "q8_quantize.cuh"
#include "warp.cuh"

// rows[r] (R rows of n_sub sub-blocks) with vectors v + g * words (g < n <= N, each n_sub
// quantized sub-blocks, Q8_WORDS words apart): dots[r][g] = the warp's sum, in every lane.
template <int TYPE, int R, int N>
__device__ __forceinline__ void q8_row_dots(const u8* const* rows, int n_sub, const unsigned* v, int words, int n,
                                            float (&dots)[R][N]) {
    constexpr int PER = Fmt<TYPE>::QK / 32;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int g = 0; g < N; ++g) dots[r][g] = 0.f;
    for (int j = threadIdx.x & 31; j < n_sub; j += 32) {
        Q8Sub w[R];  // this lane's sub-block of each row, unpacked once for every vector
#pragma unroll
        for (int r = 0; r < R; ++r) q8_unpack<TYPE>(rows[r] + (j / PER) * Fmt<TYPE>::BYTES, j % PER, &w[r]);
#pragma unroll
        for (int g = 0; g < N; ++g)
            if (g < n) {
                unsigned x[Q8_WORDS];
                q8_words(v + g * words + Q8_WORDS * j, x);
#pragma unroll
                for (int r = 0; r < R; ++r) dots[r][g] += w[r].dot(x);
            }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int g = 0; g < N; ++g)
            if (g < n) dots[r][g] = warp_sum(dots[r][g]);
}
