// Decode's dense projections read as the file stores them: a few rows x [T, K] times W [N, K] in
// GGML blocks of an integer type of q8_dot.cuh (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K), the input quantized
// to 8 bits first (quantize_q8 in moe_decode.cu). At batch 1 a projection is a matrix-vector
// product bound by the weights' bytes: Q8_0 is 1.06 bytes a weight where bf16 is 2, Q4_K 0.56.
//
//   dense_q8<TYPE>: grid ceil(N / warps), 32 * warps threads, a warp a row of W (its lanes over
//                   the row's 32-weight sub-blocks, each sub-block's integers dotted with every
//                   row of x); shared: T * K / 32 * Q8_WORDS words (x quantized, staged once).
//                   xq [T, K / 32 * Q8_WORDS] -> out [T, N] bf16 (the fp32 sum rounded once).
//
// The twin (kernels/dense.py, dense_reference): q8_values(x) @ dequantized W in fp32, rounded to
// bf16; the two differ in the order and rounding of the fp32 sums only.
#include <cuda_bf16.h>

#include "q8_rows.cuh"

constexpr int DENSE_MAX_ROWS = 8;  // rows of x a launch takes (kernels/dense.py splits more)

template <int TYPE>
__global__ void dense_q8(const unsigned* __restrict__ xq, int T, int K, const u8* __restrict__ w, long long row_bytes,
                         int N, __nv_bfloat16* __restrict__ out) {
    extern __shared__ __align__(16) unsigned xs[];  // [T, K / 32 * Q8_WORDS]
    const int n_sub = K / 32, words = n_sub * Q8_WORDS;
    for (int i = threadIdx.x; i < T * words / 4; i += blockDim.x)
        reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(xq)[i];
    __syncthreads();
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * warps + (threadIdx.x >> 5);
    if (n >= N) return;  // whole warps, after the block's last barrier
    const u8* row = w + (long long)n * row_bytes;
    float dots[1][DENSE_MAX_ROWS];  // the row's sub-blocks unpacked once, dotted with every row of x
    q8_row_dots<TYPE, 1, DENSE_MAX_ROWS>(&row, n_sub, xs, words, T, dots);
    if (lane == 0)
#pragma unroll
        for (int t = 0; t < DENSE_MAX_ROWS; ++t)
            if (t < T) out[(long long)t * N + n] = __float2bfloat16_rn(dots[0][t]);
}

#define DENSE_INSTANTIATE(TYPE)                                                                        \
    template __global__ void dense_q8<TYPE>(const unsigned*, int, int, const u8*, long long, int, \
                                            __nv_bfloat16*);
Q8_DOT_TYPES(DENSE_INSTANTIATE)
