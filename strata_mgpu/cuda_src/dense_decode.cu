// Decode's dense projections read as the file stores them: a few rows x [T, K] times W [N, K] in
// GGML blocks of an integer type of q8_dot.cuh (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4), the input quantized
// to 8 bits first (quantize_q8 in moe_decode.cu). At batch 1 a projection is a matrix-vector
// product bound by the weights' bytes: Q8_0 is 1.06 bytes a weight where bf16 is 2, Q4_K 0.56.
//
//   dense_q8<TYPE, R>: grid ceil(N / (warps * R)), 32 * warps threads, a warp R rows of W (its
//                   lanes over the rows' 32-weight sub-blocks, each sub-block's integers dotted
//                   with every row of x, x's words loaded once for the R rows); shared:
//                   T * K / 32 * Q8_WORDS words (x quantized, staged once a block).
//                   xq [T, K / 32 * Q8_WORDS] -> out [T, N] bf16 (the fp32 sum rounded once).
//                   R > 1 where x has several rows: each weight then meets T vectors, and the
//                   shared-memory loads of those vectors, not the weights' bytes, bound the warp;
//                   R rows share each load (kernels/dense.py picks R so the grid still fills the card).
//
// The twin (kernels/dense.py, dense_reference): q8_values(x) @ dequantized W in fp32, rounded to
// bf16; the two differ in the order and rounding of the fp32 sums only.
#include <cuda_bf16.h>

#include "q8_rows.cuh"

constexpr int DENSE_MAX_ROWS = 8;  // rows of x a launch takes (kernels/dense.py splits more)

template <int TYPE, int R>
__global__ void dense_q8(const unsigned* __restrict__ xq, int T, int K, const u8* __restrict__ w, long long row_bytes,
                         int N, __nv_bfloat16* __restrict__ out) {
    extern __shared__ __align__(16) unsigned xs[];  // [T, K / 32 * Q8_WORDS]
    const int n_sub = K / 32, words = n_sub * Q8_WORDS;
    for (int i = threadIdx.x; i < T * words / 4; i += blockDim.x)
        reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(xq)[i];
    __syncthreads();
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * R;
    if (n0 >= N) return;  // whole warps, after the block's last barrier
    const u8* rows[R];  // past N: the last row again, its dots not stored
#pragma unroll
    for (int r = 0; r < R; ++r) rows[r] = w + (long long)min(n0 + r, N - 1) * row_bytes;
    float dots[R][DENSE_MAX_ROWS];  // each row's sub-blocks unpacked once, dotted with every row of x
    q8_row_dots<TYPE, R, DENSE_MAX_ROWS>(rows, n_sub, xs, words, T, dots);
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int t = 0; t < DENSE_MAX_ROWS; ++t)
                if (t < T && n0 + r < N) out[(long long)t * N + n0 + r] = __float2bfloat16_rn(dots[r][t]);
}

#define DENSE_INSTANTIATE_R(TYPE, R)                                                                  \
    template __global__ void dense_q8<TYPE, R>(const unsigned*, int, int, const u8*, long long, int, \
                                               __nv_bfloat16*);
#define DENSE_INSTANTIATE(TYPE) DENSE_INSTANTIATE_R(TYPE, 1) DENSE_INSTANTIATE_R(TYPE, 2) DENSE_INSTANTIATE_R(TYPE, 4)
Q8_DOT_TYPES(DENSE_INSTANTIATE)
