// Dot products of GGML sub-blocks with activations quantized to 8 bits, 32 values a scale: the
// integer path of decode's fused expert kernels (moe_decode.cu), after llama.cpp's q8_1 idea.
//
// Dequantizing each weight to a float, rounding it to bf16 and multiplying in fp32 costs about a
// dozen instructions a weight, two of them conversions at a quarter of the fp32 rate: enough to
// make the fused kernels ALU-bound, far below the memory's speed (docs/BENCHMARKS.md). Here a
// sub-block's quantized values stay integers, four multiply-adds an instruction (__dp4a) against
// the 8-bit activations, and the block's scales come in once per 16 or 32 weights:
//
//     sum_l w_l x_l = dx * sum_halves (scale_h * sum_l q_l xq_l - offset_h * sum_l xq_l)
//
// for w_l = scale_h * q_l - offset_h (every type here has that form, a scale and an offset for
// each 16-weight half of a sub-block, mostly the same for both halves) and x_l = dx * xq_l. A
// codebook type's q_l are its codebook's integers (MXFP4: E2M1 doubled, looked up in registers).
//
// A quantized sub-block of activations (`quantize_q8` writes them, Q8_WORDS words each, 48 bytes:
// a warp's 16-byte shared-memory loads at that stride hit distinct banks):
//   words 0-7  xq_0..xq_31, signed bytes, little-endian (value l is byte l % 4 of word l / 4)
//   word 8     dx, fp32 bits: max|x| / 127 (0 for an all-zero run, whose xq are all 0)
//   words 9-10 sum of xq over values 0-15, over values 16-31 (int32)
//   word 11    unused
// xq_l = round-to-nearest-even(x_l / dx): the torch twin (kernels/experts.py, q8_values) computes
// the same integers, so the two differ only in the order and rounding of the fp32 sums.
#pragma once
#include "ggml_blocks.cuh"

constexpr int Q8_WORDS = 12;

// Which types have an integer dot (the others run moe_decode.cu's float path); kernels/experts.py's
// Q8_DOT_TYPES must list the same ids (tests/test_q8_dot.py checks).
template <int TYPE> struct Q8Dot { static constexpr bool ok = false; };
#define Q8_DOT_TYPES(X) X(2) X(8) X(12) X(13) X(14) X(39)
#define Q8_DOT_OK(T) \
    template <> struct Q8Dot<T> { static constexpr bool ok = true; };
Q8_DOT_TYPES(Q8_DOT_OK)

__device__ __forceinline__ int dot4x4(const unsigned* q, const unsigned* x) {  // 16 byte pairs
    int s = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) s = __dp4a((int)q[k], (int)x[k], s);
    return s;
}

// A sub-block unpacked: its 32 integers q (8 words of signed bytes) and, for each 16-weight half,
// the scale and offset that make its weights w = scale * q - offset. Unpacked once, it can be
// dotted with several quantized vectors (dense_decode.cu: every row of x).
struct Q8Sub {
    unsigned q[8];
    float s0, o0, s1, o1;

    // dx * sum_h (scale_h * isum_h - offset_h * xsum_h) with the activations x (Q8_WORDS words).
    __device__ __forceinline__ float dot(const unsigned* x) const {
        const float h0 = __fsub_rn(__fmul_rn(s0, (float)dot4x4(q, x)), __fmul_rn(o0, (float)(int)x[9]));
        const float h1 = __fsub_rn(__fmul_rn(s1, (float)dot4x4(q + 4, x + 4)), __fmul_rn(o1, (float)(int)x[10]));
        return __fmul_rn(__uint_as_float(x[8]), __fadd_rn(h0, h1));
    }
};

// Sub-block j of the block at b unpacked.
template <int TYPE>
__device__ __forceinline__ void q8_unpack(const u8* b, int j, Q8Sub* u);

// Sub-block j of the block at b dotted with the activations x (Q8_WORDS words, as above).
template <int TYPE>
__device__ __forceinline__ float q8_dot(const u8* b, int j, const unsigned* x) {
    Q8Sub u;
    q8_unpack<TYPE>(b, j, &u);
    return u.dot(x);
}

// Q8_0 [d:f16][qs:int8 x32]: w = d * q
template <> __device__ __forceinline__ void q8_unpack<8>(const u8* b, int, Q8Sub* u) {
    const float d = f16_at(b);
    load32(b + 2, u->q);
    u->s0 = u->s1 = d;
    u->o0 = u->o1 = 0.f;
}

// Q4_0 [d:f16][qs:16]: w = d * q - 8 d; values 0-15 the low nibbles, 16-31 the high ones
template <> __device__ __forceinline__ void q8_unpack<2>(const u8* b, int, Q8Sub* u) {
    const float d = f16_at(b);
    unsigned w[4];
    load_words<4>(b + 2, w);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u->q[k] = w[k] & 0x0F0F0F0Fu;
        u->q[4 + k] = (w[k] >> 4) & 0x0F0F0F0Fu;
    }
    u->s0 = u->s1 = d;
    u->o0 = u->o1 = __fmul_rn(d, 8.f);
}

// Q4_K: w = (d * sc) * q - (dmin * m), as sub_block<12>
template <> __device__ __forceinline__ void q8_unpack<12>(const u8* b, int j, Q8Sub* u) {
    k4_scale_min(b, j, &u->s0, &u->o0);
    u->s1 = u->s0;
    u->o1 = u->o0;
    q4k_values(b, j, u->q);
}

// Q5_K: as Q4_K with a fifth bit from qh, as sub_block<13>
template <> __device__ __forceinline__ void q8_unpack<13>(const u8* b, int j, Q8Sub* u) {
    k4_scale_min(b, j, &u->s0, &u->o0);
    u->s1 = u->s0;
    u->o1 = u->o0;
    q5k_values(b, j, u->q);
}

// Q6_K: w = (d * sc_h) * q - 32 (d * sc_h), a scale for each 16-weight half, as sub_block<14>
template <> __device__ __forceinline__ void q8_unpack<14>(const u8* b, int j, Q8Sub* u) {
    const int h = j >> 2, g = j & 3;
    q6k_values(b, j, u->q);
    const signed char* sc = reinterpret_cast<const signed char*>(b + 192 + 8 * h);
    const float d = f16_at(b + 208);
    u->s0 = __fmul_rn(d, (float)sc[2 * g]);
    u->s1 = __fmul_rn(d, (float)sc[2 * g + 1]);
    u->o0 = __fmul_rn(u->s0, 32.f);
    u->o1 = __fmul_rn(u->s1, 32.f);
}

// MXFP4 [e:e8m0][qs:16]: w = d * q, d half of 2^(e - 127), q the doubled E2M1 codebook's integer
// (-12..12); values 0-15 the low nibbles' codes, 16-31 the high ones', as sub_block<39>
template <> __device__ __forceinline__ void q8_unpack<39>(const u8* b, int, Q8Sub* u) {
    unsigned w[4];
    load_words<4>(b + 1, w);
#pragma unroll
    for (int k = 0; k < 4; ++k) table16_bytes(w[k], MXFP4_TABLE, &u->q[k], &u->q[4 + k]);
    u->s0 = u->s1 = e8m0_half(b[0]);
    u->o0 = u->o1 = 0.f;
}
