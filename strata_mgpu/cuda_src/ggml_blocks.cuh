// GGML quantized blocks, decoded 32 weights at a time on the device: shared by the dequant
// kernel (dequant.cu) and the fused decode expert kernels (moe_decode.cu).
// Arithmetic is written with __fmul_rn/__fadd_rn/__fsub_rn so it rounds exactly like the torch
// twin (strata_mgpu/quant/dequant.py): fp32 products in the same order, no fused multiply-add.
// Quantized blocks may start at any byte (MXFP4's are 17 bytes long, Q6_K's 210): they are read
// byte by byte, or (the 32-byte runs of Q8_0, Q4_K, Q5_K, Q6_K) as aligned words realigned by funnel shifts;
// F32 and F16 rows are read in words of their own size, which their offsets are multiples of.
// The IQ grid types look their weights up in ggml's grids (iq_grids.cuh, generated from the tables
// the torch twin reads), one grid row (a word) for every 8 or 4 weights.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "iq_grids.cuh"

typedef unsigned char u8;

// The ggml type ids with a decoder here, for the explicit instantiations of dequant.cu and
// moe_decode.cu: quant/formats.py's cuda_dequant (and fused_decode) types, which
// tests/test_nvrtc_compile.py checks against this list.
#define GGML_CUDA_TYPES(X) X(0) X(1) X(2) X(3) X(6) X(7) X(8) X(10) X(11) X(12) X(13) X(14) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(29) X(30) X(34) X(35) X(39)

__device__ __forceinline__ float f16_at(const u8* p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
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

// Byte q (0..15) of the 16-byte little-endian table w0..w3, as a signed value: a codebook in
// registers (a table in memory would serialize a warp's divergent lookups).
__device__ __forceinline__ int table16(unsigned w0, unsigned w1, unsigned w2, unsigned w3, int q) {
    const unsigned w = q < 8 ? (q < 4 ? w0 : w1) : (q < 12 ? w2 : w3);
    return (int)(signed char)(w >> (8 * (q & 3)));
}

// IQ4_NL/IQ4_XS codebook: -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113.
__device__ __forceinline__ float iq4_value(int q) {
    return (float)table16(0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u, q);
}

// MXFP4 (E2M1) codebook, doubled: 0 1 2 3 4 6 8 12 0 -1 -2 -3 -4 -6 -8 -12 (signed bytes, low first).
#define MXFP4_TABLE 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu
__device__ __forceinline__ float mxfp4_value(int q) { return (float)table16(MXFP4_TABLE, q); }

// MXFP4's scale byte e as half of 2^(e - 127), ggml_e8m0_to_fp32_half's bits: subnormal for e < 2,
// 2^127 at most (e = 255 is no NaN here, as in ggml); the halving pairs with the doubled codebook.
__device__ __forceinline__ float e8m0_half(unsigned e) { return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23); }

// The 8 nibbles of word q as 8 codebook bytes (the table's 16 signed bytes in words t0..t3): the
// low nibbles' values in *lo, the high nibbles' in *hi, byte k from byte k of q; four byte permutes
// a word (ggml-cuda's get_int_from_table_16), no table in memory. __byte_perm reads the low 3 bits
// of each selector nibble: a nibble picks within t0:t1 and within t2:t3, its bit 3 between them.
__device__ __forceinline__ void table16_bytes(unsigned q, unsigned t0, unsigned t1, unsigned t2, unsigned t3,
                                              unsigned* lo, unsigned* hi) {
    const unsigned pick = 0x32103210u | ((q & 0x88888888u) >> 1);
    unsigned v[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // v[i]: the values of nibbles 4i .. 4i + 3 of q, in order
        const unsigned s = q >> (16 * i);
        v[i] = __byte_perm(__byte_perm(t0, t1, s), __byte_perm(t2, t3, s), pick >> (16 * i));
    }
    *lo = __byte_perm(v[0], v[1], 0x6420);
    *hi = __byte_perm(v[0], v[1], 0x7531);
}

// The 4N bytes at p (any alignment) as N little-endian words: read as aligned 4-byte words (N + 1
// at most, never past the word holding p[4N - 1]) and realigned with funnel shifts: a quarter of
// the loads of reading them byte by byte. In the fused decode kernels those byte loads from shared
// memory (two-way bank conflicts) cost more shared-memory cycles than all else (docs/BENCHMARKS.md).
template <int N>
__device__ __forceinline__ void load_words(const u8* p, unsigned* w) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    const unsigned* q = reinterpret_cast<const unsigned*>(a & ~3ull);
    const unsigned shift = (unsigned)(a & 3) * 8;
    unsigned x[N + 1];
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = q[k];
    x[N] = shift ? q[N] : 0u;
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = __funnelshift_r(x[k], x[k + 1], shift);
}
__device__ __forceinline__ void load32(const u8* p, unsigned* w) { load_words<8>(p, w); }  // a 32-byte run

// Every byte of the words load32 filled shifted right by `shift` (0..7) and masked (8 shifts a
// run, not one a byte); then byte i (0..31) is one byte permute.
template <unsigned MASK>
__device__ __forceinline__ void shift_words(unsigned* w, int shift) {
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = (w[k] >> shift) & (MASK * 0x01010101u);
}
__device__ __forceinline__ int byte_of(const unsigned* w, int i) {
    return (int)__byte_perm(w[i >> 2], 0u, 0x4440u | (unsigned)(i & 3));  // byte i & 3, zero-extended: one PRMT
}
// Byte i as a signed value (__byte_perm reads 3 bits a selector: no sign extension there).
__device__ __forceinline__ int sbyte_of(const unsigned* w, int i) { return (signed char)(unsigned char)byte_of(w, i); }

// Weight l (0..31) of a 32-weight run packed as 16 low nibbles then 16 high nibbles.
__device__ __forceinline__ int nibble(const u8* qs, int l) { return l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4; }

// Q4_K/Q5_K sub-block j's weights are d * q - m: d = block d * its scale, m = block dmin * its min.
__device__ __forceinline__ void k4_scale_min(const u8* b, int j, float* d, float* m) {
    float sc, mn;
    scale_min_k4(j, b + 4, &sc, &mn);
    *d = __fmul_rn(f16_at(b), sc);
    *m = __fmul_rn(f16_at(b + 2), mn);
}

// Sub-block j's 32 quantized values of a K-quant block at b, one a byte, as 8 words: Q4_K's
// nibbles, Q5_K's 5-bit values, Q6_K's 6-bit values (before their -32). The decoders below and
// the integer dots (q8_dot.cuh) share them.
__device__ __forceinline__ void q4k_values(const u8* b, int j, unsigned* qs) {
    load32(b + 16 + 32 * (j >> 1), qs);
    shift_words<0xF>(qs, (j & 1) * 4);  // each byte now its nibble
}
__device__ __forceinline__ void q5k_values(const u8* b, int j, unsigned* qs) {
    unsigned qh[8];
    load32(b + 16, qh);
    load32(b + 48 + 32 * (j >> 1), qs);
    shift_words<0xF>(qs, (j & 1) * 4);
    shift_words<0x1>(qh, j);
#pragma unroll
    for (int k = 0; k < 8; ++k) qs[k] |= qh[k] << 4;  // each byte now its 5-bit value
}
__device__ __forceinline__ void q6k_values(const u8* b, int j, unsigned* ql) {
    const int h = j >> 2, g = j & 3;  // j = 4 * half + group; weights half*128 + group*32 + l
    unsigned qh[8];
    load32(b + 64 * h + ((g & 1) ? 32 : 0), ql);
    load32(b + 128 + 32 * h, qh);
    shift_words<0xF>(ql, (g >> 1) * 4);
    shift_words<0x3>(qh, 2 * g);
#pragma unroll
    for (int k = 0; k < 8; ++k) ql[k] |= qh[k] << 4;  // each byte now its 6-bit value
}

template <int TYPE> struct Fmt;
template <> struct Fmt<0> { static const int QK = 32, BYTES = 128; };   // F32, taken 32 at a time
template <> struct Fmt<1> { static const int QK = 32, BYTES = 64; };    // F16, taken 32 at a time
template <> struct Fmt<8> { static const int QK = 32, BYTES = 34; };    // Q8_0
template <> struct Fmt<12> { static const int QK = 256, BYTES = 144; }; // Q4_K
template <> struct Fmt<13> { static const int QK = 256, BYTES = 176; }; // Q5_K
template <> struct Fmt<14> { static const int QK = 256, BYTES = 210; }; // Q6_K
template <> struct Fmt<2> { static const int QK = 32, BYTES = 18; };    // Q4_0
template <> struct Fmt<3> { static const int QK = 32, BYTES = 20; };    // Q4_1
template <> struct Fmt<6> { static const int QK = 32, BYTES = 22; };    // Q5_0
template <> struct Fmt<7> { static const int QK = 32, BYTES = 24; };    // Q5_1
template <> struct Fmt<10> { static const int QK = 256, BYTES = 84; };  // Q2_K
template <> struct Fmt<11> { static const int QK = 256, BYTES = 110; }; // Q3_K
template <> struct Fmt<20> { static const int QK = 32, BYTES = 18; };   // IQ4_NL
template <> struct Fmt<23> { static const int QK = 256, BYTES = 136; }; // IQ4_XS
template <> struct Fmt<30> { static const int QK = 32, BYTES = 64; };   // BF16, taken 32 at a time
template <> struct Fmt<39> { static const int QK = 32, BYTES = 17; };   // MXFP4
template <> struct Fmt<16> { static const int QK = 256, BYTES = 66; };  // IQ2_XXS
template <> struct Fmt<17> { static const int QK = 256, BYTES = 74; };  // IQ2_XS
template <> struct Fmt<22> { static const int QK = 256, BYTES = 82; };  // IQ2_S
template <> struct Fmt<18> { static const int QK = 256, BYTES = 98; };  // IQ3_XXS
template <> struct Fmt<21> { static const int QK = 256, BYTES = 110; }; // IQ3_S
template <> struct Fmt<19> { static const int QK = 256, BYTES = 50; };  // IQ1_S
template <> struct Fmt<29> { static const int QK = 256, BYTES = 56; };  // IQ1_M
template <> struct Fmt<34> { static const int QK = 256, BYTES = 54; };  // TQ1_0
template <> struct Fmt<35> { static const int QK = 256, BYTES = 66; };  // TQ2_0

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
    unsigned q[8];
    load32(b + 2, q);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn(d, (float)sbyte_of(q, l));
}

template <> __device__ __forceinline__ void sub_block<12>(const u8* b, int j, float* v) {
    float d, m;
    k4_scale_min(b, j, &d, &m);
    unsigned qs[8];
    q4k_values(b, j, qs);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fsub_rn(__fmul_rn(d, (float)byte_of(qs, l)), m);
}

template <> __device__ __forceinline__ void sub_block<13>(const u8* b, int j, float* v) {
    float d, m;
    k4_scale_min(b, j, &d, &m);
    unsigned qs[8];
    q5k_values(b, j, qs);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = byte_of(qs, l);
        v[l] = __fsub_rn(__fmul_rn(d, (float)q), m);
    }
}

template <> __device__ __forceinline__ void sub_block<14>(const u8* b, int j, float* v) {
    const int h = j >> 2, g = j & 3;
    unsigned ql[8];
    q6k_values(b, j, ql);
    const signed char* sc = reinterpret_cast<const signed char*>(b + 192 + 8 * h);
    const float d = f16_at(b + 208);
    const float ds[2] = {__fmul_rn(d, (float)sc[2 * g]), __fmul_rn(d, (float)sc[2 * g + 1])};  // 16 weights each
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn(ds[l >> 4], (float)(byte_of(ql, l) - 32));
}

template <> __device__ __forceinline__ void sub_block<30>(const u8* b, int, float* v) {
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __uint_as_float((unsigned)(b[2 * l] | (b[2 * l + 1] << 8)) << 16);
}

// Q4_0 [d:f16][qs:16]: d * (q - 8)
template <> __device__ __forceinline__ void sub_block<2>(const u8* b, int, float* v) {
    const float d = f16_at(b);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn(d, (float)(nibble(b + 2, l) - 8));
}

// Q4_1 [d:f16][m:f16][qs:16]: d * q + m
template <> __device__ __forceinline__ void sub_block<3>(const u8* b, int, float* v) {
    const float d = f16_at(b), m = f16_at(b + 2);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fadd_rn(__fmul_rn(d, (float)nibble(b + 4, l)), m);
}

// Q5_0 [d:f16][qh:u32][qs:16]: d * (q - 16), bit l of qh the 5th bit of weight l
template <> __device__ __forceinline__ void sub_block<6>(const u8* b, int, float* v) {
    const float d = f16_at(b);
    const unsigned qh = b[2] | (b[3] << 8) | (b[4] << 16) | ((unsigned)b[5] << 24);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = nibble(b + 6, l) | (int)((qh >> l) & 1) << 4;  // int: q - 16 may be negative
        v[l] = __fmul_rn(d, (float)(q - 16));
    }
}

// Q5_1 [d:f16][m:f16][qh:u32][qs:16]: d * q + m
template <> __device__ __forceinline__ void sub_block<7>(const u8* b, int, float* v) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const unsigned qh = b[4] | (b[5] << 8) | (b[6] << 16) | ((unsigned)b[7] << 24);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fadd_rn(__fmul_rn(d, (float)(nibble(b + 8, l) | (((qh >> l) & 1) << 4))), m);
}

// Q2_K [scales:16][qs:64][d:f16][dmin:f16]: sub-block j = 4 h + s is bits 2s..2s+1 of qs[32 h + l];
// 16 weights share scales byte i: (d * (i & 15)) * q - dmin * (i >> 4)
template <> __device__ __forceinline__ void sub_block<10>(const u8* b, int j, float* v) {
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    const u8* qs = b + 16 + 32 * (j >> 2);
    const int shift = 2 * (j & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int sc = b[2 * j + half];
        const float dl = __fmul_rn(d, (float)(sc & 0xF)), ml = __fmul_rn(dmin, (float)(sc >> 4));
#pragma unroll
        for (int l = 16 * half; l < 16 * half + 16; ++l) v[l] = __fsub_rn(__fmul_rn(dl, (float)((qs[l] >> shift) & 3)), ml);
    }
}

// Q3_K [hmask:32][qs:64][scales:12][d:f16]: low 2 bits as Q2_K's, bit j of hmask[l] clear means
// -4; 16 weights share a 6-bit scale (low 4 bits in bytes 0..7, high 2 in bytes 8..11), minus 32.
template <> __device__ __forceinline__ void sub_block<11>(const u8* b, int j, float* v) {
    const float d = f16_at(b + 108);
    const u8* qs = b + 32 + 32 * (j >> 2);
    const u8* sc = b + 96;
    const int shift = 2 * (j & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int i = 2 * j + half;
        const int low = i < 8 ? sc[i] & 0xF : sc[i - 8] >> 4, high = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        const float dl = __fmul_rn(d, (float)((low | (high << 4)) - 32));
#pragma unroll
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const int q = ((qs[l] >> shift) & 3) - (((b[l] >> j) & 1) ? 0 : 4);
            v[l] = __fmul_rn(dl, (float)q);
        }
    }
}

// IQ4_NL [d:f16][qs:16]: d * codebook[q]
template <> __device__ __forceinline__ void sub_block<20>(const u8* b, int, float* v) {
    const float d = f16_at(b);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn(d, iq4_value(nibble(b + 2, l)));
}

// IQ4_XS [d:f16][scales_h:u16][scales_l:4][qs:128]: sub-block j's 6-bit scale is nibble j of
// scales_l (low) and bits 2j..2j+1 of scales_h (high), minus 32; (d * scale) * codebook[q]
template <> __device__ __forceinline__ void sub_block<23>(const u8* b, int j, float* v) {
    const int high = ((b[2] | (b[3] << 8)) >> (2 * j)) & 3, low = (b[4 + (j >> 1)] >> (4 * (j & 1))) & 0xF;
    const float dl = __fmul_rn(f16_at(b), (float)((low | (high << 4)) - 32));
    const u8* qs = b + 8 + 16 * j;
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn(dl, iq4_value(nibble(qs, l)));
}

// MXFP4 [e:e8m0][qs:16]: half of 2^(e - 127) (ggml_e8m0_to_fp32_half) * doubled codebook[q]
template <> __device__ __forceinline__ void sub_block<39>(const u8* b, int, float* v) {
    const float d = e8m0_half(b[0]);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = __fmul_rn(d, mxfp4_value(nibble(b + 1, l)));
}

// ---- The IQ grid types and the ternary ones: sub-block j = weights 32 j .. 32 j + 31 of a 256-weight
// block, in ggml's order of products (dequantize_row_iq2_xxs, ...): (scale * grid) * sign, the sign
// a multiplication by -1 or 1 (a zero keeps its sign, as in C). Bytes are read one at a time: a block
// may start at any byte.

constexpr float IQ1S_DELTA = 0.125f;  // IQ1_S, IQ1_M: a weight is scale * (grid + or - this)

__device__ __forceinline__ unsigned u16_at(const u8* p) { return p[0] | (p[1] << 8); }
__device__ __forceinline__ unsigned u32_at(const u8* p) {
    return p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned)p[3] << 24);
}

// Weight k of a grid row (byte k of its word): unsigned (IQ2, IQ3) or signed (iq1s_grid's -1 0 1).
__device__ __forceinline__ float grid_u8(unsigned long long row, int k) {
    return (float)(unsigned)((row >> (8 * k)) & 0xFF);
}
__device__ __forceinline__ float grid_s8(unsigned long long row, int k) {
    return (float)(signed char)((row >> (8 * k)) & 0xFF);
}

// (scale * g) * -1 where bit k of `signs` is set, else * 1.
__device__ __forceinline__ float signed_weight(float scale, float g, unsigned signs, int k) {
    return __fmul_rn(__fmul_rn(scale, g), ((signs >> k) & 1) ? -1.f : 1.f);
}

// 8 weights from one row of an 8-wide grid and 8 sign bits.
__device__ __forceinline__ void iq_group8(float scale, unsigned long long row, unsigned signs, float* v) {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = signed_weight(scale, grid_u8(row, k), signs, k);
}

// 8 weights from two rows of a 4-wide grid (IQ3) and 8 sign bits.
__device__ __forceinline__ void iq_group4x2(float scale, unsigned row0, unsigned row1, unsigned signs, float* v) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[k] = signed_weight(scale, grid_u8(row0, k), signs, k);
        v[k + 4] = signed_weight(scale, grid_u8(row1, k), signs, k + 4);
    }
}

// The IQ2 types' scale of a group: (d * (0.5 + ls)) * 0.25.
__device__ __forceinline__ float iq2_scale(float d, unsigned ls) {
    return __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)ls)), 0.25f);
}

// IQ2_XXS [d:f16][qs:64]: sub-block j is bytes 2 + 8 j ..: four grid indices, then a u32 of 4 x 7
// sign bits (ksigns_iq2xs indices) and the 4-bit scale in bits 28-31
template <> __device__ __forceinline__ void sub_block<16>(const u8* b, int j, float* v) {
    const u8* q = b + 2 + 8 * j;
    const unsigned aux = u32_at(q + 4);
    const float db = iq2_scale(f16_at(b), aux >> 28);
#pragma unroll
    for (int l = 0; l < 4; ++l) iq_group8(db, iq2xxs_grid[q[l]], ksigns_iq2xs[(aux >> (7 * l)) & 127], v + 8 * l);
}

// IQ2_XS [d:f16][qs:u16 x32][scales:8]: group g (8 weights) is u16 g, grid index in bits 0-8, sign
// index in 9-15; groups 4 j, 4 j + 1 take scale byte j's low nibble, 4 j + 2, 4 j + 3 its high one
template <> __device__ __forceinline__ void sub_block<17>(const u8* b, int j, float* v) {
    const float d = f16_at(b);
    const unsigned sc = b[66 + j];
    const float db[2] = {iq2_scale(d, sc & 0xF), iq2_scale(d, sc >> 4)};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned q = u16_at(b + 2 + 2 * (4 * j + l));
        iq_group8(db[l >> 1], iq2xs_grid[q & 511], ksigns_iq2xs[q >> 9], v + 8 * l);
    }
}

// IQ2_S [d:f16][qs:32][signs:32][qh:8][scales:8]: group g's grid index is qs[g] | bits 2(g % 4)..
// of qh[g / 4] << 8, its signs the byte signs[g]; scales as IQ2_XS
template <> __device__ __forceinline__ void sub_block<22>(const u8* b, int j, float* v) {
    const float d = f16_at(b);
    const unsigned sc = b[74 + j], qh = b[66 + j];
    const float db[2] = {iq2_scale(d, sc & 0xF), iq2_scale(d, sc >> 4)};
#pragma unroll
    for (int l = 0; l < 4; ++l)
        iq_group8(db[l >> 1], iq2s_grid[b[2 + 4 * j + l] | (((qh >> (2 * l)) & 3) << 8)], b[34 + 4 * j + l], v + 8 * l);
}

// IQ3_XXS [d:f16][qs:64][scales_signs:u32 x8]: sub-block j reads grid indices qs[8 j ..] (4 weights
// each) and u32 j: 4 x 7 sign bits (8 weights each), the scale in bits 28-31: (d * (0.5 + s)) * 0.5
template <> __device__ __forceinline__ void sub_block<18>(const u8* b, int j, float* v) {
    const u8* q = b + 2 + 8 * j;
    const unsigned aux = u32_at(b + 66 + 4 * j);
    const float db = __fmul_rn(__fmul_rn(f16_at(b), __fadd_rn(0.5f, (float)(aux >> 28))), 0.5f);
#pragma unroll
    for (int l = 0; l < 4; ++l)
        iq_group4x2(db, iq3xxs_grid[q[2 * l]], iq3xxs_grid[q[2 * l + 1]], ksigns_iq2xs[(aux >> (7 * l)) & 127],
                    v + 8 * l);
}

// IQ3_S [d:f16][qs:64][qh:8][signs:32][scales:4]: grid index k of sub-block j is qs[8 j + k] | bit k of
// qh[j] << 8; signs[4 j + l] bit by bit; scale nibble j (low nibble first): d * (1 + 2 s)
template <> __device__ __forceinline__ void sub_block<21>(const u8* b, int j, float* v) {
    const u8* q = b + 2 + 8 * j;
    const unsigned qh = b[66 + j];
    const float db = __fmul_rn(f16_at(b), (float)(1 + 2 * ((b[106 + (j >> 1)] >> (4 * (j & 1))) & 0xF)));
#pragma unroll
    for (int l = 0; l < 4; ++l)
        iq_group4x2(db, iq3s_grid[q[2 * l] | (((qh >> (2 * l)) & 1) << 8)],
                    iq3s_grid[q[2 * l + 1] | (((qh >> (2 * l + 1)) & 1) << 8)], b[74 + 4 * j + l], v + 8 * l);
}

// IQ1_S [d:f16][qs:32][qh:u16 x8]: u16 qh[j] holds in bits 3l..3l+2 the grid index bits 8-10 of
// group l (qs[4 j + l] the low 8), in 12-14 the scale s, in 15 the delta's sign:
// (d * (2 s + 1)) * (grid + delta)
template <> __device__ __forceinline__ void sub_block<19>(const u8* b, int j, float* v) {
    const unsigned qh = u16_at(b + 34 + 2 * j);
    const float dl = __fmul_rn(f16_at(b), (float)(2 * ((qh >> 12) & 7) + 1));
    const float delta = (qh & 0x8000) ? -IQ1S_DELTA : IQ1S_DELTA;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned long long row = iq1s_grid[b[2 + 4 * j + l] | (((qh >> (3 * l)) & 7) << 8)];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[8 * l + k] = __fmul_rn(dl, __fadd_rn(grid_s8(row, k), delta));
    }
}

// IQ1_M [qs:32][qh:16][scales:u16 x4]: group g (8 weights) takes nibble g of qh (low nibble first):
// grid index bits 8-10 (qs[g] the low 8), the delta's sign in bit 3; its scale s is 3-bit field g / 2
// of the scale words (four a word from bit 0), whose top nibbles are the fp16 d, lowest first
template <> __device__ __forceinline__ void sub_block<29>(const u8* b, int j, float* v) {
    const unsigned s0 = u16_at(b + 48), s1 = u16_at(b + 50), s2 = u16_at(b + 52), s3 = u16_at(b + 54);
    const float d = __half2float(__ushort_as_half(
        (unsigned short)((s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000))));
    const unsigned sc = u16_at(b + 48 + 2 * (j >> 1));
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const int g = 4 * j + l;
        const float dl = __fmul_rn(d, (float)(2 * ((sc >> (6 * (j & 1) + 3 * (l >> 1))) & 7) + 1));
        const unsigned nib = (b[32 + (g >> 1)] >> (4 * (g & 1))) & 0xF;
        const unsigned long long row = iq1s_grid[b[g] | ((nib & 7) << 8)];
        const float delta = (nib & 8) ? -IQ1S_DELTA : IQ1S_DELTA;
#pragma unroll
        for (int k = 0; k < 8; ++k) v[8 * l + k] = __fmul_rn(dl, __fadd_rn(grid_s8(row, k), delta));
    }
}

// TQ1_0 [qs:48][qh:4][d:f16]: a byte holds 5 (qh: 4) base-3 digits; digit n is ((byte * 3^n mod 256)
// * 3) >> 8, a weight (digit - 1) * d. Weights 0-159 are qs[w % 32]'s digit w / 32, 160-239
// qs[32 + (w - 160) % 16]'s digit (w - 160) / 16, 240-255 qh[(w - 240) % 4]'s digit (w - 240) / 4.
template <> __device__ __forceinline__ void sub_block<34>(const u8* b, int j, float* v) {
    const float d = f16_at(b + 52);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int w = 32 * j + l;
        const int pos = w < 160 ? (w & 31) : w < 240 ? 32 + ((w - 160) & 15) : 48 + ((w - 240) & 3);
        const int n = w < 160 ? (w >> 5) : w < 240 ? ((w - 160) >> 4) : ((w - 240) >> 2);
        const unsigned pow3 = n < 4 ? (0x1B090301u >> (8 * n)) & 0xFF : 81u;  // 1 3 9 27 81
        const unsigned q = (b[pos] * pow3) & 0xFF;
        v[l] = __fmul_rn((float)((int)((q * 3) >> 8) - 1), d);
    }
}

// TQ2_0 [qs:64][d:f16]: weight 128 h + 32 l + m is bits 2l..2l+1 of qs[32 h + m], minus 1, times d
template <> __device__ __forceinline__ void sub_block<35>(const u8* b, int j, float* v) {
    const float d = f16_at(b + 64);
    const u8* qs = b + 32 * (j >> 2);
    const int shift = 2 * (j & 3);
#pragma unroll
    for (int m = 0; m < 32; ++m) v[m] = __fmul_rn((float)((int)((qs[m] >> shift) & 3) - 1), d);
}
