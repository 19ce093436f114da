// Warp-wide reductions shared by the decode kernels (decode_ops.cu, decode_attention.cu): every
// lane gets the result.
#pragma once

#define NEG_INF_F __int_as_float(0xff800000)  // -inf (NVRTC has no math.h for INFINITY)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
