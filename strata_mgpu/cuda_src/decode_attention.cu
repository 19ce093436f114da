// Decode attention for a batch of sequences in two launches a layer, the work split over the keys
// (flash-decoding), so that the cost follows each sequence's length, not its cache's capacity.
//
// Row b of the batch is one new token of sequence b: q [B, H, Dh] bf16 (normed and rotated), its
// keys and values its positions 0..positions[b]. The caches are found through a table of B rows
// of 5 int64 (kernels.decode_ops.kv_table_row): k base, v base, the keys' layer stride in their
// elements, a block table's address or 0, log2 of its block tokens or 0. Layer `layer`'s keys are
// [cells, Hkv, Dh] bf16 at k_base + layer * stride; position p sits in cell p, or, where the row
// has a block table bt (int32, a paged cache: k/v base are the pool's, shared by its sequences),
// in cell bt[p >> shift] << shift | p & (2^shift - 1). With KQ8 (VQ8) the keys (values)
// are ggml Q8_0 blocks instead, [cells, Hkv, Dh / 32 * 34] bytes (fp16 d, 32 int8 q: x = d q),
// dequantized in the tile load (x rounded to bf16, as the twin's load), the other's layer stride
// following from the keys' (the same cells).
//
//   attn_split<DH, KQ8, VQ8>:  grid (Hkv * C, S, B), 32 * WARPS threads, C = ceil(G / HC). Block (g * C + c, s, b)
//                    takes query heads [c * HC, min((c + 1) * HC, G)) of KV head g's G = H / Hkv and the
//                    keys [s * W, min((s + 1) * W, pos + 1)) (W = row_split_keys: the row's own
//                    keys over all S splits, at most L), in tiles of TK keys, tile i to warp
//                    i % WARPS (a tile's first position a multiple of TK: SPLIT_GRANULE is, and so
//                    its TK cells lie in one block of a paged cache, one table load a tile). Each
//                    warp streams its tiles' keys and values into its own ring of
//                    shared memory (cp.async, NS tiles in flight, no block barrier in the loop; Q8_0
//                    cells through registers, dequantized to bf16 on the way), scores a
//                    tile on the tensor cores (bf16 products, fp32 sums), keeps a running max and sum
//                    (online softmax), and adds p * v on the fp32 cores; the warps are merged at the
//                    end in warp order -> part_o [B, H, S, DH] (the unnormalized sum of 2^(t - m) * v,
//                    t = score * log2(e)), part_ml [B, H, S, 2] (m, the sum of 2^(t - m)), m in log2
//                    units. A split past the row's position writes m = -inf, l = 0.
//   attn_combine<DH>: grid (H, B), DH / 4 * CG threads: the splits merged -> out [B, H, DH] bf16.
//
// Everything in fp32 from the bf16 inputs, one rounding at the end: the torch twin (SDPA over the
// masked cache) rounds the same way up to the order of the sums (the tensor cores add a score's
// 16-term blocks in their own order). Needs sm_80 (mma.sync on bf16, cp.async); the launcher sends
// older cards to the twin, and here they get kernels that trap.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "warp.cuh"

typedef __nv_bfloat16 bf16;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define ATTN_SM80 1
#else
#define ATTN_SM80 0
#endif

constexpr int HC = 8;           // query heads a block takes: the used rows of the mma's 16
constexpr int TK = 8;           // keys a tile: the mma's 8 columns
constexpr int WARPS = 2;        // warps a block (kernels.decode_ops.ATTN_WARPS)
constexpr int RING = 16 << 10;  // bytes of a warp's ring: NS stages of a tile's keys and values (4 * TK * DH bytes)
constexpr int CG = 8;           // split groups of attn_combine (kernels.decode_ops.ATTN_COMBINE_GROUPS)
constexpr int KV_ROW = 5;       // int64 a row of the caches' table (kernels.decode_ops.KV_TABLE_COLUMNS)
constexpr float LOG2E = 1.4426950408889634f;

// n (2, 4 or 8) consecutive bf16 at p (aligned to their size) as floats, in one load.
template <int N>
__device__ __forceinline__ void load_bf16(const bf16* p, float* f) {
    if constexpr (N == 8) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(u[i] << 16);
            f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    } else if constexpr (N == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        f[0] = __uint_as_float(w.x << 16), f[1] = __uint_as_float(w.x & 0xffff0000u);
        f[2] = __uint_as_float(w.y << 16), f[3] = __uint_as_float(w.y & 0xffff0000u);
    } else {
        const unsigned w = *reinterpret_cast<const unsigned*>(p);
        f[0] = __uint_as_float(w << 16), f[1] = __uint_as_float(w & 0xffff0000u);
    }
}

// 16 bytes from global to shared, not through registers; zeros where !valid (src must still be a
// mapped address).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
#if ATTN_SM80
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(valid ? 16 : 0));
#endif
}

__device__ __forceinline__ void copy_commit() {
#if ATTN_SM80
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void copy_wait() {
#if ATTN_SM80
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// c += a @ b: a 16 x 16 bf16 (rows: query heads, 8..15 zero here), b 16 x 8 bf16 (columns: keys), c
// fp32. Lane (r = lane / 4, t = lane % 4) gives a's row r at columns {2t, 2t + 1} (a0) and
// {2t + 8, 2t + 9} (a2), b's column r at the same rows (b0, b1), and gets c's row r at columns
// 2t, 2t + 1 (c[0], c[1]; c[2], c[3]: row r + 8).
__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
#if ATTN_SM80
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// The 8 values [8 p, 8 p + 8) of a head's Q8_0 row `src` (Dh / 32 blocks of 34 bytes, 2-byte aligned)
// as bf16 into 16 bytes of shared memory at dst (zeros where !valid): x = d q in fp32, rounded once.
__device__ __forceinline__ void load_q8_0_piece(bf16* dst, const unsigned char* src, int p, bool valid) {
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (valid) {
        const unsigned char* blk = src + (p >> 2) * 34;
        const float d = __half2float(*reinterpret_cast<const __half*>(blk));
        const unsigned short* qs = reinterpret_cast<const unsigned short*>(blk + 2 + (p & 3) * 8);
        unsigned u[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned short two = qs[i];
            const __nv_bfloat162 x = __floats2bfloat162_rn((float)(signed char)(two & 0xff) * d,
                                                           (float)(signed char)(two >> 8) * d);
            u[i] = *reinterpret_cast<const unsigned*>(&x);
        }
        w = make_uint4(u[0], u[1], u[2], u[3]);
    }
    *reinterpret_cast<uint4*>(dst) = w;
}

// Keys each split of a row at `pos` takes: its pos + 1 keys spread over all S splits, in multiples
// of SPLIT_GRANULE (whole tiles for every warp), at most the launch's L (the plan for the capacity,
// S * L cells). A row much shorter than the capacity still fills the card: a graph captured for
// 64K cells gives a 32K-token row 128 splits of 288 keys, not 64 of 512 (half the blocks idle, the
// others twice as long). attn_combine finds the same splits from the same numbers.
#ifndef SPLIT_GRANULE  // kernels/decode_ops.py's ATTN_MIN_KEYS, given at compile time (ATTN_DEFINES)
#error "SPLIT_GRANULE: compile with -DSPLIT_GRANULE=<ATTN_MIN_KEYS> (kernels/decode_ops.py)"
#endif
static_assert(SPLIT_GRANULE % TK == 0, "a split starts a tile: a tile's keys then lie in one block");
__device__ __forceinline__ int row_split_keys(long long pos, int L, int S) {
    const long long per = (pos + S) / S;  // ceil((pos + 1) / S)
    return (int)min((long long)L, (per + SPLIT_GRANULE - 1) / SPLIT_GRANULE * SPLIT_GRANULE);
}

template <int DH, bool KQ8, bool VQ8>
__global__ void __launch_bounds__(32 * WARPS)
    attn_split(const bf16* __restrict__ q, const long long* __restrict__ table, int layer,
               const long long* __restrict__ positions, int H, int Hkv, float scale, int L, int S,
               float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int NS = RING / (4 * TK * DH);  // stages of a warp's ring: 8, 4, 2 for DH 64, 128, 256
    constexpr int KC = DH / 32;               // 16-byte pieces of a key a lane scores; of a tile a lane copies
    constexpr int DPL = DH / 32;              // value dims a lane sums
    constexpr int TILE = TK * DH;             // bf16 of a tile's keys (and of its values)
    static_assert(NS >= 2 && HC * DH * 4 <= RING, "a ring holds two stages, and a warp's sums at the end");
    // ring[w][stage]: the tile's keys [TK, DH] then its values [TK, DH]. A key's 16-byte pieces are
    // stored with piece index ^ 4 on odd keys, so the 8 lanes of a quarter-warp reading pieces
    // 4i + t of keys r, r + 1 hit distinct banks. sc[w]: p [TK, HC], then the heads' rescales.
    __shared__ __align__(16) bf16 ring[WARPS][NS][2 * TILE];
    __shared__ __align__(16) float sc[WARPS][(TK + 1) * HC];
    const int G = H / Hkv, C = (G + HC - 1) / HC;
    const int g = blockIdx.x / C, c = blockIdx.x % C, s = blockIdx.y, b = blockIdx.z;
    const int hc = min(HC, G - c * HC);  // heads of this block
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, t = lane & 3;
    const long long pos = positions[b];
    const int W = row_split_keys(pos, L, S);
    const long long j0 = (long long)s * W;
    const int n = (int)min((long long)W, pos + 1 - j0);  // keys in this split
    const long long head0 = (long long)b * H + (long long)g * G + c * HC;  // the block's first query head
    if (n <= 0) {
        for (int h = threadIdx.x; h < hc; h += blockDim.x) {
            part_ml[((head0 + h) * S + s) * 2] = NEG_INF_F;
            part_ml[((head0 + h) * S + s) * 2 + 1] = 0.f;
        }
        return;
    }
    const long long* cache = table + KV_ROW * b;
    const long long stride = cache[2];
    const bf16* kc = reinterpret_cast<const bf16*>(cache[0]) + layer * stride + g * DH;
    const bf16* vc = reinterpret_cast<const bf16*>(cache[1]) + layer * stride + g * DH;
    const int* blocks = reinterpret_cast<const int*>(cache[3]);  // null: cell = position
    const int shift = (int)cache[4];
    const long long row = (long long)Hkv * DH;  // elements from one position to the next
    // Q8_0 cells: a head's row of QB bytes, a position's of Hkv * QB; a layer's bytes from the keys' stride
    constexpr int QB = DH / 32 * 34;
    const long long k_layer = KQ8 ? stride : 2 * stride;
    const long long v_layer = KQ8 == VQ8 ? k_layer : KQ8 ? k_layer / QB * (2 * DH) : k_layer / (2 * DH) * QB;
    const unsigned char* kq = reinterpret_cast<const unsigned char*>(cache[0]) + layer * k_layer + g * QB;
    const unsigned char* vq = reinterpret_cast<const unsigned char*>(cache[1]) + layer * v_layer + g * QB;
    if constexpr (KQ8 && !VQ8)  // bf16 values after Q8_0 keys: their layer stride is not the keys'
        vc = reinterpret_cast<const bf16*>(cache[1] + layer * v_layer) + g * DH;
    const int tiles = (n + TK - 1) / TK, mine = (tiles - warp + WARPS - 1) / WARPS;  // this warp's: warp + k * WARPS

    // Tile k of this warp into stage k % NS: lane copies piece f % (DH / 8) of key f / (DH / 8) for
    // f = i * 32 + lane (whole rows a warp instruction); keys past the split read as zeros (from the
    // split's last cell, a mapped one). Every call commits a group, empty or not, so that
    // copy_wait's count is the tile's.
    auto fetch = [&](int k) {
        if (k < mine) {
            bf16* st = ring[warp][k % NS];
            const int k0 = (warp + k * WARPS) * TK;
            long long first = j0 + k0;  // the tile's first key: its cell, the others' follow it
            if (blocks != nullptr) first = ((long long)blocks[first >> shift] << shift) | (first & ((1LL << shift) - 1));
#pragma unroll
            for (int i = 0; i < KC; ++i) {
                const int f = i * 32 + lane, jj = f / (DH / 8), pc = f % (DH / 8);
                const long long cell = first + (min(k0 + jj, n - 1) - k0), at = cell * row + pc * 8;
                bf16* kd = st + jj * DH + (pc ^ ((jj & 1) << 2)) * 8;
                if constexpr (KQ8) load_q8_0_piece(kd, kq + cell * Hkv * QB, pc, k0 + jj < n);
                else copy16(kd, kc + at, k0 + jj < n);
                if constexpr (VQ8) load_q8_0_piece(st + TILE + jj * DH + pc * 8, vq + cell * Hkv * QB, pc, k0 + jj < n);
                else copy16(st + TILE + jj * DH + pc * 8, vc + at, k0 + jj < n);
            }
        }
        copy_commit();
    };
#pragma unroll
    for (int k = 0; k < NS - 1; ++k) fetch(k);

    // This lane's part of the mma's a: query head r's dims 32 i + 8 t .. + 8 (zero past the block's
    // heads). Its key pieces below are the same dims of key r, so each 16-dim step pairs them alike.
    uint4 qf[KC];
#pragma unroll
    for (int i = 0; i < KC; ++i) qf[i] = make_uint4(0u, 0u, 0u, 0u);
    if (r < hc) {
        const bf16* qh = q + (head0 + r) * DH + 8 * t;
#pragma unroll
        for (int i = 0; i < KC; ++i) qf[i] = *reinterpret_cast<const uint4*>(qh + 32 * i);
    }
    const float scale2 = scale * LOG2E;
    float m = NEG_INF_F, l = 0.f;  // head r's running max (log2 units) and this lane's part of its sum
    float acc[HC][DPL];            // P @ V: heads x this lane's dims lane * DPL .. + DPL
#pragma unroll
    for (int h = 0; h < HC; ++h)
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[h][e] = 0.f;
    float* p = sc[warp];
    for (int k = 0; k < mine; ++k) {
        fetch(k + NS - 1);
        copy_wait<NS - 1>();
        __syncwarp();  // every lane's copies of tile k are visible
        const bf16* kt = ring[warp][k % NS];
        const bf16* vt = kt + TILE;
        // Scores of head r with keys 2t, 2t + 1 of the tile: DH / 16 mma steps, even and odd ones in
        // two chains.
        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < KC; ++i) {
            const uint4 kw = *reinterpret_cast<const uint4*>(kt + r * DH + ((4 * i + t) ^ ((r & 1) << 2)) * 8);
            mma_bf16(s0, qf[i].x, qf[i].y, kw.x, kw.y);
            mma_bf16(s1, qf[i].z, qf[i].w, kw.z, kw.w);
        }
        const int key = (warp + k * WARPS) * TK + 2 * t;  // within the split
        const float x0 = key < n ? (s0[0] + s1[0]) * scale2 : NEG_INF_F;
        const float x1 = key + 1 < n ? (s0[1] + s1[1]) * scale2 : NEG_INF_F;
        float mt = fmaxf(x0, x1);  // the tile's max for head r: the 4 lanes of the row
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        const float mn = fmaxf(m, mt);  // finite: the tile's first key is in the split
        const float alpha = exp2f(m - mn), p0 = exp2f(x0 - mn), p1 = exp2f(x1 - mn);
        const bool grew = mn > m;
        m = mn;
        l = fmaf(l, alpha, p0 + p1);
        p[(2 * t) * HC + r] = p0;
        p[(2 * t + 1) * HC + r] = p1;
        if (t == 0) p[TK * HC + r] = alpha;
        __syncwarp();
        if (__any_sync(0xffffffffu, grew)) {  // a head's max grew: its sums so far scale by alpha
            const float4* p4 = reinterpret_cast<const float4*>(p);
            const float4 a = p4[2 * TK], z = p4[2 * TK + 1];
            const float al[HC] = {a.x, a.y, a.z, a.w, z.x, z.y, z.z, z.w};
#pragma unroll
            for (int h = 0; h < HC; ++h)
#pragma unroll
                for (int e = 0; e < DPL; ++e) acc[h][e] *= al[h];
        }
        // P @ V: each key's value row (a lane DPL dims) times the key's p for every head
#pragma unroll
        for (int j = 0; j < TK; ++j) {
            float v[DPL];
            load_bf16<DPL>(vt + j * DH + lane * DPL, v);
            const float4 a = reinterpret_cast<const float4*>(p)[2 * j];
            const float4 z = reinterpret_cast<const float4*>(p)[2 * j + 1];
            const float pj[HC] = {a.x, a.y, a.z, a.w, z.x, z.y, z.z, z.w};
#pragma unroll
            for (int h = 0; h < HC; ++h)
#pragma unroll
                for (int e = 0; e < DPL; ++e) acc[h][e] = fmaf(pj[h], v[e], acc[h][e]);
        }
        __syncwarp();  // the stage and p are read before the next tile refills them
    }
    copy_wait<0>();  // the groups left are empty; none may land on the sums below
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // The warps merged in warp order: each leaves its sums [HC, DH] fp32 over its own ring and (m, l)
    // of its heads in sc, so the result does not depend on timing. A warp without tiles leaves
    // m = -inf, l = 0, zero sums.
    float* o = reinterpret_cast<float*>(ring[warp]);
#pragma unroll
    for (int h = 0; h < HC; ++h)
#pragma unroll
        for (int e = 0; e < DPL; ++e) o[h * DH + lane * DPL + e] = acc[h][e];
    if (t == 0) p[r] = m, p[HC + r] = l;
    __syncthreads();
    for (int i = threadIdx.x; i < hc * DH; i += blockDim.x) {
        const int h = i / DH;
        float mx = NEG_INF_F, sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sc[w][h]);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            sum = fmaf(reinterpret_cast<const float*>(ring[w])[i], exp2f(sc[w][h] - mx), sum);
        }
        part_o[((head0 + h) * S + s) * DH + i % DH] = sum;
    }
    for (int h = threadIdx.x; h < hc; h += blockDim.x) {
        float mx = NEG_INF_F, sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sc[w][h]);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum = fmaf(sc[w][HC + h], exp2f(sc[w][h] - mx), sum);
        part_ml[((head0 + h) * S + s) * 2] = mx;
        part_ml[((head0 + h) * S + s) * 2 + 1] = sum;
    }
}

// A thread 4 dims (DH / 4 threads a row) of the splits s = sg, sg + CG, ... (its split group sg),
// read CU splits at a time before any is used (many loads in flight), the groups' sums then added
// in group order: the same order every run.
template <int DH>
__global__ void __launch_bounds__(DH / 4 * CG, 1)  // 1: ptxas then keeps the CU loads in flight
    attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                 const long long* __restrict__ positions, int H, int L, int S, bf16* __restrict__ out) {
    constexpr int R = DH / 4, WN = R * CG / 32, CU = 8;
    __shared__ float4 po[CG][R];
    __shared__ float pl[CG], wm[WN];
    const int h = blockIdx.x, b = blockIdx.y, d4 = threadIdx.x % R, sg = threadIdx.x / R;
    const long long head = (long long)b * H + h;
    const int used = (int)min((long long)S, positions[b] / row_split_keys(positions[b], L, S) + 1);
    const float2* ml = reinterpret_cast<const float2*>(part_ml + head * S * 2);  // (m, l) of each split
    float m = NEG_INF_F;
    for (int i = threadIdx.x; i < used; i += blockDim.x) m = fmaxf(m, ml[i].x);
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) wm[threadIdx.x >> 5] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < WN; ++w) m = fmaxf(m, wm[w]);
    const float4* src = reinterpret_cast<const float4*>(part_o + head * S * DH) + d4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    float l = 0.f;
    for (int i0 = sg; i0 < used; i0 += CG * CU) {
        float4 v[CU];
        float2 w[CU];
#pragma unroll
        for (int u = 0; u < CU; ++u) {
            const int i = min(i0 + u * CG, used - 1);  // a split past `used` reads a used one, weighs 0
            v[u] = src[(long long)i * R];
            w[u] = ml[i];
        }
#pragma unroll
        for (int u = 0; u < CU; ++u) {
            const float e = i0 + u * CG < used ? exp2f(w[u].x - m) : 0.f;
            l = fmaf(w[u].y, e, l);
            o.x = fmaf(v[u].x, e, o.x), o.y = fmaf(v[u].y, e, o.y), o.z = fmaf(v[u].z, e, o.z);
            o.w = fmaf(v[u].w, e, o.w);
        }
    }
    po[sg][d4] = o;
    if (d4 == 0) pl[sg] = l;
    __syncthreads();
    if (sg == 0) {
        for (int i = 1; i < CG; ++i) {
            const float4 v = po[i][d4];
            o.x += v.x, o.y += v.y, o.z += v.z, o.w += v.w, l += pl[i];
        }
        __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + head * DH + 4 * d4);
        dst[0] = __floats2bfloat162_rn(o.x / l, o.y / l);
        dst[1] = __floats2bfloat162_rn(o.z / l, o.w / l);
    }
}

#define ATTN_SPLIT_INSTANTIATE(DH, KQ8, VQ8)                                                                 \
    template __global__ void attn_split<DH, KQ8, VQ8>(const bf16*, const long long*, int, const long long*,    \
                                                      int, int, float, int, int, float*, float*);
#define ATTN_INSTANTIATE(DH)                                                                                 \
    ATTN_SPLIT_INSTANTIATE(DH, false, false)                                                                 \
    ATTN_SPLIT_INSTANTIATE(DH, true, false)                                                                  \
    ATTN_SPLIT_INSTANTIATE(DH, false, true)                                                                  \
    ATTN_SPLIT_INSTANTIATE(DH, true, true)                                                                   \
    template __global__ void attn_combine<DH>(const float*, const float*, const long long*, int, int, int, bf16*);
ATTN_INSTANTIATE(64)
ATTN_INSTANTIATE(128)
ATTN_INSTANTIATE(256)
