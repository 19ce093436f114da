// The small ops of a decode step, fused: each replaces several elementwise launches of its torch
// twin (reference.py). At batch 1 those launches, not their arithmetic, are the cost.
//
// Rounding follows the twins where they round: RMSNorm in fp32, its result rounded to bf16 before
// the weight multiplies; RoPE on bf16 values with bf16 cos/sin tables, each product and the sum
// rounded; routing in fp32.
//
//   rms_norm_rows:     x [R, N] -> out [R, N]                 out = rmsnorm(x) * w
//   add_rms_norm_rows: x [R, N] += y [R, N]; out = rmsnorm(x) * w
//   qk_norm_rope_kv:   B rows, each one token of its own sequence: q [B, H, Dh], k, v [B, Hkv, Dh]
//                      -> q normed and its first R dims rotated by row b's cos/sin [B, R] (into q_out); k normed,
//                      rotated and v written into row b's KV cache at positions[b] (its cell, through
//                      the cache's block table where it has one); its _k8, _v8
//                      and _k8v8 variants store keys, values or both as ggml Q8_0 blocks
//   route_rows:        h [T, D] bf16, router [E, D] fp32 -> logits [T, E] fp32, then (by the
//                      last block of each row) the A largest softmax probabilities (renormalized
//                      over the A when `renorm`) and their experts, largest first
//   moe_input_rows:    the MoE block's input in one launch: add_rms_norm_rows (into x_out, not in
//                      place) + route_rows + h quantized for the integer experts (q8_quantize.cuh)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "q8_quantize.cuh"
#include "warp.cuh"

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `partial` may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.f;
    return warp_sum(v);
}

// One row per block. With y: x += y first (rounded to bf16, as the twin's bf16 add), in place.
__device__ void norm_row(bf16* x, const bf16* y, const bf16* w, int n, float eps, bf16* out) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = __bfloat162float(x[i]);
        if (y) {
            v = bf16r(v + __bfloat162float(y[i]));
            x[i] = __float2bfloat16_rn(v);
        }
        ss += v * v;
    }
    const float rstd = rsqrtf(block_sum(ss) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)  // each thread re-reads only what it wrote
        out[i] = __float2bfloat16_rn(bf16r(__bfloat162float(x[i]) * rstd) * __bfloat162float(w[i]));
}

extern "C" __global__ void rms_norm_rows(bf16* x, const bf16* __restrict__ w, int n, float eps, bf16* __restrict__ out) {
    norm_row(x + (long long)blockIdx.x * n, nullptr, w, n, eps, out + (long long)blockIdx.x * n);
}

extern "C" __global__ void add_rms_norm_rows(bf16* x, const bf16* __restrict__ y, const bf16* __restrict__ w, int n, float eps,
                                  bf16* __restrict__ out) {
    const long long r = (long long)blockIdx.x * n;
    norm_row(x + r, y + r, w, n, eps, out + r);
}

// One warp: the 32 values x (lane l holding value l of the run) as a ggml Q8_0 block at dst (34
// bytes: fp16 d, then 32 int8), rounded as ggml's quantize_row_q8_0_ref and the twin
// (quant/quantize.py): d = amax / 127, q = roundf(x * (1 / d)), 0 where d is 0.
__device__ __forceinline__ void store_q8_0_run(float x, unsigned char* dst) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(x));
    const float d = amax / 127.f;  // IEEE division (NVRTC without fast math), as ggml's
    const float id = d != 0.f ? 1.f / d : 0.f;
    dst[2 + lane] = (unsigned char)(signed char)(int)roundf(x * id);
    if (lane == 0) *reinterpret_cast<__half*>(dst) = __float2half_rn(d);  // blocks are 2-byte aligned
}

constexpr int KV_ROW = 5;  // int64 a row of the caches' table (kernels.decode_ops.KV_TABLE_COLUMNS)

// Bytes of a head's Dh values as stored: bf16, or Dh / 32 Q8_0 blocks.
template <bool Q8>
__device__ __forceinline__ long long head_bytes(int Dh) { return Q8 ? Dh / 32 * 34 : 2LL * Dh; }

// grid (H + 2 Hkv, B), one warp a head: blocks 0..H-1 are q's heads, H..H+Hkv-1 k's, then v's.
// Dh <= 256, even (a multiple of 32 where a Q8 variant stores it). Row b of q, k, v starts at b *
// its row stride (elements; the three may be column blocks of one fused projection). Row b's
// cache (`table` row b, 5 int64 as in decode_attention.cu: k base, v base, the keys' layer stride
// in their elements, the values' following from it, a block table's address or 0, log2 of its
// block tokens or 0): layer `layer`'s cells [cells, Hkv, Dh] bf16 (or [cells, Hkv, Dh / 32 * 34]
// bytes of Q8_0 blocks, KQ8 / VQ8); the cell of position positions[b] is written (the position
// itself, or through the block table: bt[p >> shift] << shift | p & (2^shift - 1)).
// q's result goes to q_out [B, H, Dh]. Rotation of each head's first R dims (R even, <= Dh; R = Dh
// for most models, 64 of 256 for Qwen3.5's) by the host's tables cos, sin [B, R] (ops.rope_cos_sin:
// RoPE's scaling, YaRN's attention factor included, lives there): NEOX pairs (d, d + R / 2); the
// dims from R on pass as they are, as the twin's apply_rope.
template <bool KQ8, bool VQ8>
__device__ __forceinline__ void qk_norm_rope_kv_row(const bf16* q, long long q_stride, const bf16* __restrict__ k,
                                long long k_stride, const bf16* __restrict__ v, long long v_stride,
                                const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm, int H, int Hkv,
                                int Dh, const long long* __restrict__ positions, const bf16* __restrict__ cos_table,
                                const bf16* __restrict__ sin_table, int R, float eps,
                                const long long* __restrict__ table, int layer, bf16* __restrict__ q_out) {
    const int head = blockIdx.x, lane = threadIdx.x, b = blockIdx.y;
    q += b * q_stride;
    k += b * k_stride;
    v += b * v_stride;
    q_out += (long long)b * H * Dh;
    cos_table += (long long)b * R;
    sin_table += (long long)b * R;
    // a layer's bytes: the keys' stride in their elements, the values' the same cells in theirs
    const long long* cache = table + KV_ROW * b;
    const long long k_layer = cache[2] * (KQ8 ? 1 : 2);
    const long long v_layer = KQ8 == VQ8 ? k_layer : k_layer / head_bytes<KQ8>(Dh) * head_bytes<VQ8>(Dh);
    unsigned char* k_bytes = reinterpret_cast<unsigned char*>(cache[0]) + layer * k_layer;
    unsigned char* v_bytes = reinterpret_cast<unsigned char*>(cache[1]) + layer * v_layer;
    bf16* k_cache = reinterpret_cast<bf16*>(k_bytes);
    bf16* v_cache = reinterpret_cast<bf16*>(v_bytes);
    const int* blocks = reinterpret_cast<const int*>(cache[3]);
    long long cell = positions[b];  // the written cell: the position's, or its block's through the table
    if (blocks != nullptr) {
        const int shift = (int)cache[4];
        cell = ((long long)blocks[cell >> shift] << shift) | (cell & ((1LL << shift) - 1));
    }
    const long long row = cell * Hkv * Dh;
    if (head >= H + Hkv) {  // v: a copy into the cache (quantized a run of 32 at a time)
        const int hv = head - H - Hkv;
        if constexpr (VQ8) {
            unsigned char* dst = v_bytes + (cell * Hkv + hv) * head_bytes<true>(Dh);
            for (int j = 0; j < Dh / 32; ++j) store_q8_0_run(__bfloat162float(v[hv * Dh + 32 * j + lane]), dst + 34 * j);
        } else {
            for (int d = lane; d < Dh; d += 32) v_cache[row + hv * Dh + d] = v[hv * Dh + d];
        }
        return;
    }
    const bool is_q = head < H;
    const bf16* src = is_q ? q + head * Dh : k + (head - H) * Dh;
    const bf16* w = is_q ? q_norm : k_norm;
    bf16* dst = is_q ? q_out + head * Dh : k_cache + row + (head - H) * Dh;
    float x[8], nx[8];  // this lane's values: d = lane + 32 * j
    float ss = 0.f;
    const int per = Dh / 32;
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < per) {
            x[j] = __bfloat162float(src[lane + 32 * j]);
            ss += x[j] * x[j];
        }
    const float rstd = rsqrtf(warp_sum(ss) / Dh + eps);
    const int half = R / 2;
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < per) nx[j] = bf16r(bf16r(x[j] * rstd) * __bfloat162float(w[lane + 32 * j]));
    float out[8];
    if (R == Dh) {
        // The partner of d is d + half (or d - half): `per / 2` slots away in this same lane when Dh is
        // a multiple of 64; otherwise read it through the other lanes.
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (j < per) {
                const int d = lane + 32 * j;
                const float c = __bfloat162float(cos_table[d]), s = __bfloat162float(sin_table[d]);
                float partner;
                if ((half & 31) == 0) {
                    const int jp = d < half ? j + half / 32 : j - half / 32;
                    partner = nx[jp < 0 ? 0 : (jp > 7 ? 7 : jp)];
                } else {
                    partner = 0.f;  // unreachable for the Dh the host allows (multiples of 64)
                }
                const float rot = d < half ? -partner : partner;  // rotate_half: [-x2, x1]
                out[j] = bf16r(bf16r(nx[j] * c) + bf16r(rot * s));
            }
    } else {
        // A part of the head rotated: its pairs cross lanes and slots for any R, so the warp's normed
        // head goes through shared memory (this block's one warp) and each lane reads its partners there.
        __shared__ float head_values[256];
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (j < per) head_values[lane + 32 * j] = nx[j];
        __syncwarp();
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (j < per) {
                const int d = lane + 32 * j;
                if (d < R) {
                    const float c = __bfloat162float(cos_table[d]), s = __bfloat162float(sin_table[d]);
                    const float partner = head_values[d < half ? d + half : d - half];
                    const float rot = d < half ? -partner : partner;  // rotate_half over the first R dims
                    out[j] = bf16r(bf16r(nx[j] * c) + bf16r(rot * s));
                } else {
                    out[j] = nx[j];
                }
            }
    }
    if constexpr (KQ8) {
        if (!is_q) {  // the rotated key (bf16 values) quantized: block j is value lane of run j
            unsigned char* kq = k_bytes + (cell * Hkv + (head - H)) * head_bytes<true>(Dh);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (j < per) store_q8_0_run(out[j], kq + 34 * j);
            return;
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < per) dst[lane + 32 * j] = __float2bfloat16_rn(out[j]);
}

#define QK_NORM_ROPE_KV(NAME, KQ8, VQ8)                                                                          \
    extern "C" __global__ void NAME(const bf16* q, long long q_stride, const bf16* __restrict__ k,                \
                                    long long k_stride, const bf16* __restrict__ v, long long v_stride,           \
                                    const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm, int H,      \
                                    int Hkv, int Dh, const long long* __restrict__ positions,                     \
                                    const bf16* __restrict__ cos_table, const bf16* __restrict__ sin_table,       \
                                    int R, float eps, const long long* __restrict__ table, int layer,             \
                                    bf16* __restrict__ q_out) {                                                   \
        qk_norm_rope_kv_row<KQ8, VQ8>(q, q_stride, k, k_stride, v, v_stride, q_norm, k_norm, H, Hkv, Dh,          \
                                      positions, cos_table, sin_table, R, eps, table, layer, q_out);              \
    }
QK_NORM_ROPE_KV(qk_norm_rope_kv, false, false)
QK_NORM_ROPE_KV(qk_norm_rope_kv_k8, true, false)
QK_NORM_ROPE_KV(qk_norm_rope_kv_v8, false, true)
QK_NORM_ROPE_KV(qk_norm_rope_kv_k8v8, true, true)

// Row t's top A of its E logits (one warp; E <= 512: 16 values a lane; A <= min(32, E)). The
// logits are read from L2 (__ldcg): other blocks of route_rows wrote them.
__device__ void topk_row(const float* l, int t, int E, int A, int renorm, float* __restrict__ weights,
                         long long* __restrict__ experts) {
    const int lane = threadIdx.x & 31;
    float p[16];
    float m = NEG_INF_F;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < E ? __ldcg(l + e) : NEG_INF_F;
        m = fmaxf(m, p[j]);
    }
    m = warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        p[j] = lane + 32 * j < E ? expf(p[j] - m) : 0.f;
        s += p[j];
    }
    s = warp_sum(s);
    float picked_sum = 0.f, picked = 0.f;
    for (int a = 0; a < A; ++a) {  // the largest remaining, lowest expert id on ties
        float best = -1.f;
        int best_e = E;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int e = lane + 32 * j;
            if (e < E && (p[j] > best || (p[j] == best && e < best_e))) {
                best = p[j];
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        const float prob = best / s;
        if (lane == a) {
            picked = prob;
            experts[(long long)t * A + a] = best_e;
        }
        picked_sum += prob;
#pragma unroll
        for (int j = 0; j < 16; ++j)
            if (lane + 32 * j == best_e) p[j] = -1.f;  // taken
    }
    if (lane < A) weights[(long long)t * A + lane] = renorm ? picked / picked_sum : picked;
}

// Called by every thread of a block of row t once its logits are written: the row's blocks count
// themselves in rows_done[t] (zero between launches: the last resets it), and the last one's first
// warp picks the row's experts (topk_row) from all the blocks' logits.
__device__ void pick_when_last(const float* logits, int t, int E, int A, int renorm, float* __restrict__ weights,
                               long long* __restrict__ experts, int* __restrict__ rows_done) {
    __shared__ bool last;
    __threadfence();  // this block's logits are visible device-wide before it counts itself
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(rows_done + t, 1) == (int)gridDim.x - 1;
        if (last) rows_done[t] = 0;  // ready for the next launch
    }
    __syncthreads();
    if (last && threadIdx.x < 32) {
        __threadfence();
        topk_row(logits + (long long)t * E, t, E, A, renorm, weights, experts);
    }
}

// One expert's logit: the warp's dot of a row of h (D values, h(i) the i-th as fp32) with its router
// row re [D] fp32. Each lane reads the router four values a load (16 bytes: D a multiple of 4, re
// 16-byte aligned) and issues ROUTER_LOADS loads before it multiplies any: a lane reading one value
// a load, each after the last one's sum, waited a memory latency per load. Every lane gets the sum.
constexpr int ROUTER_LOADS = 8;
template <typename H>
__device__ __forceinline__ float router_dot(const H& h, const float* __restrict__ re, int D) {
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
    for (int i0 = 4 * lane; i0 < D; i0 += 128 * ROUTER_LOADS) {
        float4 r[ROUTER_LOADS];
#pragma unroll
        for (int u = 0; u < ROUTER_LOADS; ++u)
            r[u] = i0 + 128 * u < D ? __ldg(reinterpret_cast<const float4*>(re + i0 + 128 * u))
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int u = 0; u < ROUTER_LOADS; ++u) {
            const int i = i0 + 128 * u;
            if (i < D) {
                acc = fmaf(h(i), r[u].x, acc);
                acc = fmaf(h(i + 1), r[u].y, acc);
                acc = fmaf(h(i + 2), r[u].z, acc);
                acc = fmaf(h(i + 3), r[u].w, acc);
            }
        }
    }
    return warp_sum(acc);
}

struct GlobalRow {  // a bf16 row in global memory
    const bf16* x;
    __device__ float operator()(int i) const { return __bfloat162float(x[i]); }
};
struct SharedRow {  // an fp32 row in shared memory
    const float* x;
    __device__ float operator()(int i) const { return x[i]; }
};

// grid (ceil(E / warps), T): one warp an expert's logit, then the row's last block picks its
// experts (pick_when_last): one launch a layer for routing, not two.
extern "C" __global__ void route_rows(const bf16* __restrict__ h, const float* __restrict__ router, int D, int E,
                                      float* __restrict__ logits, int A, int renorm, float* __restrict__ weights,
                                      long long* __restrict__ experts, int* __restrict__ rows_done) {
    const int t = blockIdx.y, e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (e < E) {
        const float acc = router_dot(GlobalRow{h + (long long)t * D}, router + (long long)e * D, D);
        if (lane == 0) logits[(long long)t * E + e] = acc;
    }
    pick_when_last(logits, t, E, A, renorm, weights, experts, rows_done);
}

// grid (ceil(E / warps), T), 32 * warps = NORM_THREADS threads (so the norm sums in
// add_rms_norm_rows' order and h equals its h); shared: D floats. Every block computes row t's
// x + y and its norm h into shared memory (2 D bf16 read, cheap beside the router's E D fp32); block
// 0 writes x_out and h; each warp takes one expert's logit, then the first D / 32 warps of the grid
// quantize one 32-value run of h each into hq [T, D / 32 * Q8_WORDS] (when hq is given), and the
// row's last block picks its experts as route_rows does. x is read, never written: other blocks
// may still be reading it.
extern "C" __global__ void moe_input_rows(const bf16* __restrict__ x, const bf16* __restrict__ y,
                                          const bf16* __restrict__ w, int D, float eps,
                                          const float* __restrict__ router, int E, float* __restrict__ logits, int A,
                                          int renorm, float* __restrict__ weights, long long* __restrict__ experts,
                                          int* __restrict__ rows_done, bf16* __restrict__ x_out,
                                          bf16* __restrict__ h_out, unsigned* __restrict__ hq) {
    extern __shared__ float hs[];  // [D]: x + y, then h
    const int t = blockIdx.y, warp = threadIdx.x >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const long long r = (long long)t * D;
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = bf16r(__bfloat162float(x[r + i]) + __bfloat162float(y[r + i]));  // the twin's bf16 add
        hs[i] = v;
        ss += v * v;
    }
    const float rstd = rsqrtf(block_sum(ss) / D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {  // each thread re-reads only what it wrote
        const float hv = bf16r(bf16r(hs[i] * rstd) * __bfloat162float(w[i]));
        if (blockIdx.x == 0) {
            x_out[r + i] = __float2bfloat16_rn(hs[i]);
            h_out[r + i] = __float2bfloat16_rn(hv);
        }
        hs[i] = hv;
    }
    __syncthreads();
    const int e = blockIdx.x * warps + warp;
    if (e < E) {
        const float acc = router_dot(SharedRow{hs}, router + (long long)e * D, D);
        if (lane == 0) logits[(long long)t * E + e] = acc;
    }
    if (hq != nullptr)
        for (int j = blockIdx.x * warps + warp; j < D / 32; j += gridDim.x * warps)
            quantize_run(hs[32 * j + lane], hq + (r / 32 + j) * Q8_WORDS);
    pick_when_last(logits, t, E, A, renorm, weights, experts, rows_done);
}
