// Activations quantized to 8 bits, 32 values a scale, by one warp: the layout q8_dot.cuh reads; and
// a quantized run read back into registers. Device code only (q8_dot.cuh itself also builds on the
// host, for its test). Shared by moe_decode.cu (quantize_q8, moe_gate_up's act), decode_ops.cu
// (moe_input_rows, the experts' input) and dense_decode.cu. The torch twin is kernels/experts.py's
// q8_values.
#pragma once
#include "q8_dot.cuh"
#include "warp.cuh"

// One warp: the 32 values v (lane l holding value l) quantized into dst's Q8_WORDS words.
__device__ __forceinline__ void quantize_run(float v, unsigned* dst) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.f;  // IEEE division, as the twin's
    const int q = amax > 0.f ? __float2int_rn(v / d) : 0;
    unsigned w = (unsigned)(q & 0xFF) << (8 * (lane & 3));  // four lanes' bytes make a word
    w |= __shfl_xor_sync(0xffffffffu, w, 1);
    w |= __shfl_xor_sync(0xffffffffu, w, 2);
    int half = q;  // the sum over this lane's 16-value half
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) half += __shfl_xor_sync(0xffffffffu, half, o);
    if ((lane & 3) == 0) dst[lane >> 2] = w;
    if (lane == 0) dst[8] = __float_as_uint(d), dst[9] = (unsigned)half;
    if (lane == 16) dst[10] = (unsigned)half;
    if (lane == 1) dst[11] = 0u;
}

// A staged sub-block's words into registers: three 16-byte loads (conflict-free at a 48-byte stride).
__device__ __forceinline__ void q8_words(const unsigned* v, unsigned* x) {
    const uint4* p = reinterpret_cast<const uint4*>(v);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        const uint4 w = p[k];
        x[4 * k] = w.x, x[4 * k + 1] = w.y, x[4 * k + 2] = w.z, x[4 * k + 3] = w.w;
    }
}
