// Decode attention for a batch of sequences in two launches a layer, the work split over the keys
// (flash-decoding), so that the cost follows each sequence's length, not its cache's capacity.
//
// Row b of the batch is one new token of sequence b: q [B, H, Dh] bf16 (normed and rotated), its
// keys and values the cells 0..positions[b] of that sequence's cache. The caches are found through
// a table of B rows (k base, v base, layer stride in elements): layer `layer`'s keys are
// [capacity, Hkv, Dh] bf16 at k_base + layer * stride.
//
//   attn_split<DH>:  grid (Hkv, S, B), 32 * warps threads. Block (g, s, b) takes keys
//                    [s * L, min((s + 1) * L, pos + 1)) of KV head g for its G = H / Hkv query heads:
//                    scores in fp32, the split's max m and sum l of exp(score - m), and the
//                    unnormalized sum of exp(score - m) * v -> part_o [B, H, S, DH], part_ml [B, H, S, 2].
//                    A split past the row's position writes m = -inf, l = 0.
//   attn_combine<DH>: grid (H, B), DH threads: the splits merged -> out [B, H, DH] bf16.
//
// Everything in fp32 from the bf16 inputs, one rounding at the end: the torch twin (SDPA over the
// masked cache) rounds the same way up to the order of the sums.
#include <cuda_bf16.h>

#include "warp.cuh"

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ void bf16x8(const uint4 w, float* f) {
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}

// DPT (2, 4 or 8) consecutive bf16 at p (aligned to their size) as floats, in one load.
template <int DPT>
__device__ __forceinline__ void load_bf16(const bf16* p, float* f) {
    if constexpr (DPT == 8) {
        bf16x8(*reinterpret_cast<const uint4*>(p), f);
    } else if constexpr (DPT == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        f[0] = __uint_as_float(w.x << 16), f[1] = __uint_as_float(w.x & 0xffff0000u);
        f[2] = __uint_as_float(w.y << 16), f[3] = __uint_as_float(w.y & 0xffff0000u);
    } else {
        const unsigned w = *reinterpret_cast<const unsigned*>(p);
        f[0] = __uint_as_float(w << 16), f[1] = __uint_as_float(w & 0xffff0000u);
    }
}

// shared: max(G, HC) * (DH + 4 TPK) floats (the query heads, then the P @ V sums) + G * L floats
// (scores, then probabilities).
constexpr int HC = 8;   // query heads a thread works on at once
constexpr int TPK = 4;  // threads sharing a key's score

template <int DH>
__global__ void attn_split(const bf16* __restrict__ q, const long long* __restrict__ table, int layer,
                           const long long* __restrict__ positions, int H, int Hkv, float scale, int L, int S,
                           float* __restrict__ part_o, float* __restrict__ part_ml) {
    extern __shared__ float smem[];
    const int g = blockIdx.x, s = blockIdx.y, b = blockIdx.z;
    const int G = H / Hkv, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const long long pos = positions[b];
    const long long j0 = (long long)s * L;
    const int n = (int)min((long long)L, pos + 1 - j0);  // keys in this split
    const long long head0 = (long long)b * H + (long long)g * G;  // the block's first query head
    if (n <= 0) {
        for (int h = threadIdx.x; h < G; h += blockDim.x) {
            part_ml[((head0 + h) * S + s) * 2] = NEG_INF_F;
            part_ml[((head0 + h) * S + s) * 2 + 1] = 0.f;
        }
        return;
    }
    const long long stride = table[3 * b + 2];
    const bf16* kc = reinterpret_cast<const bf16*>(table[3 * b]) + layer * stride + g * DH;
    const bf16* vc = reinterpret_cast<const bf16*>(table[3 * b + 1]) + layer * stride + g * DH;
    const long long row = (long long)Hkv * DH;  // elements from one position to the next
    constexpr int DPK = DH / TPK, QROW = DH + 4 * TPK;  // a query head's row: its parts 4 floats apart,
    float* qs = smem;                                    // so the TPK lanes of a key read distinct banks
    float* sc = smem + (G > HC ? G : HC) * QROW;
    for (int i = threadIdx.x; i < G * DH; i += blockDim.x) {  // head h's part p at h * QROW + p * (DPK + 4)
        const int h = i / DH, d = i % DH;
        qs[h * QROW + (d / DPK) * (DPK + 4) + d % DPK] = __bfloat162float(q[head0 * DH + i]);
    }
    __syncthreads();
    // Scores: TPK threads a key (adjacent lanes, each DPK of its dims, 16 bytes at a time; the key's
    // row read once), HC query heads at a time, the parts summed across the key's lanes.
    for (int base = 0; base < n; base += blockDim.x / TPK) {  // uniform across the block: shuffles below
        const int jj = base + threadIdx.x / TPK, part = threadIdx.x % TPK;
        const bool live = jj < n;
        const uint4* kr = reinterpret_cast<const uint4*>(kc + (j0 + (live ? jj : 0)) * row + part * DPK);
        for (int h0 = 0; h0 < G; h0 += HC) {
            float acc[HC];
#pragma unroll
            for (int h = 0; h < HC; ++h) acc[h] = 0.f;
#pragma unroll
            for (int c = 0; c < DPK / 8; ++c) {
                float f[8];
                bf16x8(kr[c], f);
#pragma unroll
                for (int h = 0; h < HC; ++h)
                    if (h0 + h < G) {
                        const float* qh = qs + (h0 + h) * QROW + part * (DPK + 4) + 8 * c;
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[h] = fmaf(f[e], qh[e], acc[h]);
                    }
            }
#pragma unroll
            for (int h = 0; h < HC; ++h) {
#pragma unroll
                for (int o = 1; o < TPK; o <<= 1) acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], o);
                if (live && part == 0 && h0 + h < G) sc[(h0 + h) * L + jj] = acc[h] * scale;
            }
        }
    }
    __syncthreads();
    // The split's softmax statistics, a warp a head; probabilities replace the scores.
    for (int h = warp; h < G; h += warps) {
        float m = NEG_INF_F;
        for (int jj = lane; jj < n; jj += 32) m = fmaxf(m, sc[h * L + jj]);
        m = warp_max(m);
        float l = 0.f;
        for (int jj = lane; jj < n; jj += 32) {
            const float p = __expf(sc[h * L + jj] - m);
            sc[h * L + jj] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            part_ml[((head0 + h) * S + s) * 2] = m;
            part_ml[((head0 + h) * S + s) * 2 + 1] = l;
        }
    }
    // P @ V: a warp every warps-th key (each value row read once), a lane DH / 32 consecutive
    // dims, HC heads at a time; the warps' sums added in warp order in shared memory (qs's room:
    // the queries are no longer needed), so the result does not depend on timing.
    constexpr int DPT = DH / 32;
    float* red = qs;  // [HC, DH]
    for (int h0 = 0; h0 < G; h0 += HC) {
        float acc[HC][DPT];
#pragma unroll
        for (int h = 0; h < HC; ++h)
#pragma unroll
            for (int e = 0; e < DPT; ++e) acc[h][e] = 0.f;
        __syncthreads();  // the scores are probabilities; red's previous readers are done
#pragma unroll 2
        for (int jj = warp; jj < n; jj += warps) {
            float f[DPT];
            load_bf16<DPT>(vc + (j0 + jj) * row + lane * DPT, f);
#pragma unroll
            for (int h = 0; h < HC; ++h)
                if (h0 + h < G) {
                    const float p = sc[(h0 + h) * L + jj];
#pragma unroll
                    for (int e = 0; e < DPT; ++e) acc[h][e] = fmaf(p, f[e], acc[h][e]);
                }
        }
        for (int w = 0; w < warps; ++w) {
            if (warp == w)
#pragma unroll
                for (int h = 0; h < HC; ++h)
#pragma unroll
                    for (int e = 0; e < DPT; ++e) {
                        float* r = red + h * DH + lane * DPT + e;
                        *r = (w == 0 ? 0.f : *r) + acc[h][e];
                    }
            __syncthreads();
        }
        for (int i = threadIdx.x; i < HC * DH; i += blockDim.x) {
            const int h = i / DH;
            if (h0 + h < G) part_o[((head0 + h0 + h) * S + s) * DH + i % DH] = red[i];
        }
    }
}

template <int DH>
__global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                             const long long* __restrict__ positions, int H, int L, int S, bf16* __restrict__ out) {
    const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
    const long long head = (long long)b * H + h;
    const int used = (int)min((long long)S, positions[b] / L + 1);
    const float* ml = part_ml + head * S * 2;
    float m = NEG_INF_F;
    for (int s = 0; s < used; ++s) m = fmaxf(m, ml[2 * s]);
    float l = 0.f, o = 0.f;
    for (int s = 0; s < used; ++s) {
        const float w = __expf(ml[2 * s] - m);
        l = fmaf(ml[2 * s + 1], w, l);
        o = fmaf(part_o[(head * S + s) * DH + d], w, o);
    }
    out[head * DH + d] = __float2bfloat16_rn(o / l);
}

#define ATTN_INSTANTIATE(DH)                                                                                 \
    template __global__ void attn_split<DH>(const bf16*, const long long*, int, const long long*, int, int,  \
                                            float, int, int, float*, float*);                                \
    template __global__ void attn_combine<DH>(const float*, const float*, const long long*, int, int, int, bf16*);
ATTN_INSTANTIATE(64)
ATTN_INSTANTIATE(128)
ATTN_INSTANTIATE(256)
