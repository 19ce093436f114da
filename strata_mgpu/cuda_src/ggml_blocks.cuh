// GGML quantized blocks, decoded 32 weights at a time on the device: shared by the dequant
// kernel (dequant.cu) and the fused decode expert kernels (moe_decode.cu).
// Arithmetic is written with __fmul_rn/__fsub_rn so it rounds exactly like the torch twin
// (strata_mgpu/quant/dequant.py): fp32 products in the same order, no fused multiply-add.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned char u8;

__device__ __forceinline__ float f16_at(const u8* p) {
    return __half2float(*reinterpret_cast<const __half*>(p));
}

// Q4_K/Q5_K 6-bit scale and min of sub-block j from the 12 packed bytes.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* mn) {
    int s, m;
    if (j < 4) {
        s = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        s = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    *sc = (float)s;
    *mn = (float)m;
}

template <int TYPE> struct Fmt;
template <> struct Fmt<0> { static const int QK = 32, BYTES = 128; };   // F32, taken 32 at a time
template <> struct Fmt<1> { static const int QK = 32, BYTES = 64; };    // F16, taken 32 at a time
template <> struct Fmt<8> { static const int QK = 32, BYTES = 34; };    // Q8_0
template <> struct Fmt<12> { static const int QK = 256, BYTES = 144; }; // Q4_K
template <> struct Fmt<13> { static const int QK = 256, BYTES = 176; }; // Q5_K
template <> struct Fmt<14> { static const int QK = 256, BYTES = 210; }; // Q6_K

template <int TYPE>
__device__ __forceinline__ void sub_block(const u8* b, int j, float* v);

template <> __device__ __forceinline__ void sub_block<0>(const u8* b, int, float* v) {
    const float* x = reinterpret_cast<const float*>(b);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = x[l];
}

template <> __device__ __forceinline__ void sub_block<1>(const u8* b, int, float* v) {
    const __half* x = reinterpret_cast<const __half*>(b);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __half2float(x[l]);
}

template <> __device__ __forceinline__ void sub_block<8>(const u8* b, int, float* v) {
    const float d = f16_at(b);
    const signed char* q = reinterpret_cast<const signed char*>(b + 2);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn(d, (float)q[l]);
}

template <> __device__ __forceinline__ void sub_block<12>(const u8* b, int j, float* v) {
    float sc, mn;
    scale_min_k4(j, b + 4, &sc, &mn);
    const float d = __fmul_rn(f16_at(b), sc), m = __fmul_rn(f16_at(b + 2), mn);
    const u8* qs = b + 16 + 32 * (j >> 1);
    const int shift = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fsub_rn(__fmul_rn(d, (float)((qs[l] >> shift) & 0xF)), m);
}

template <> __device__ __forceinline__ void sub_block<13>(const u8* b, int j, float* v) {
    float sc, mn;
    scale_min_k4(j, b + 4, &sc, &mn);
    const float d = __fmul_rn(f16_at(b), sc), m = __fmul_rn(f16_at(b + 2), mn);
    const u8* qh = b + 16;
    const u8* qs = b + 48 + 32 * (j >> 1);
    const int shift = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = ((qs[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4);
        v[l] = __fsub_rn(__fmul_rn(d, (float)q), m);
    }
}

template <> __device__ __forceinline__ void sub_block<14>(const u8* b, int j, float* v) {
    // j = 4 * half + group; weights half*128 + group*32 + l
    const int h = j >> 2, g = j & 3;
    const u8* ql = b + 64 * h + ((g & 1) ? 32 : 0);
    const u8* qh = b + 128 + 32 * h;
    const signed char* sc = reinterpret_cast<const signed char*>(b + 192 + 8 * h);
    const float d = f16_at(b + 208);
    const int lo_shift = (g >> 1) * 4, hi_shift = 2 * g;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = (((ql[l] >> lo_shift) & 0xF) | (((qh[l] >> hi_shift) & 3) << 4)) - 32;
        v[l] = __fmul_rn(__fmul_rn(d, (float)sc[2 * g + (l >> 4)]), (float)q);
    }
}
