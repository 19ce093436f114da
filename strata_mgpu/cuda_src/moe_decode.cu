// Decode's routed experts computed straight from their GGML blocks, wherever they live.
//
// A decode step touches a few experts a layer, once each. Reading their quantized bytes where they
// sit (a VRAM cache slot, or the pinned host arena through its device mapping) and multiplying in
// the same kernel saves writing a bf16 copy of every picked expert and reading it back, and about
// twenty small launches a layer (sort, address building, gather, grouped GEMM, combine).
//
// Shapes: T tokens, A picks a token, P = T * A picks (pick p = t * A + a), D hidden, F expert width.
//   moe_gate_up: x [T, D] bf16, picks [P] expert ids -> act [P, F] bf16 = silu(x Wg^T) * (x Wu^T)
//   moe_down:    act [P, F] bf16, weights [P] fp32 -> out [T, D] bf16 = sum_a w_a (act_a Wd^T)
// A pick of -1 adds nothing: the host's cores compute that expert (cpu_handover.cu) and add it after.
// Rounding follows the torch twin (GEMM outputs, SiLU and the product rounded to bf16; routing
// weights cast to bf16; an fp32 sum over the picks). The dots themselves take one of two paths:
//   integer (Q8Dot<TYPE>::ok, q8_dot.cuh: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4): the kernel's input is
//     quantized to 8 bits first (quantize_q8, below: x into xq [T, D / 32] sub-blocks, act into
//     aq [P, F / 32]) and each weight stays an integer; the twin does the same quantization.
//   float (the other types): weights rounded to bf16, as the twin's dequant does, times the bf16
//     input in fp32.
// Either way only the order and rounding of the fp32 sums inside a dot product differ from the twin.
//
// Where an expert's bytes are, and how they are laid out: moe_common.cuh.
//
// Each block stages a tile of rows (contiguous bytes) into shared memory with 16-byte loads, so
// reads of mapped host memory leave as whole, coalesced PCIe requests and many are in flight at
// once; then each warp takes one row, its lanes one 32-weight sub-block at a time.
#include "ggml_blocks.cuh"
#include "moe_common.cuh"
#include "q8_quantize.cuh"
#include "q8_rows.cuh"
#include "warp.cuh"

constexpr int MAX_PICKS = 64;  // experts a token (A) moe_down takes; kernels/experts.py checks

// 16 bytes from global (or mapped host) memory into shared memory without passing through
// registers (cp.async, sm_80 on): a thread issues all its copies before any arrives, so a block's
// whole tile is in flight at once. copies_done() waits for the thread's own; a barrier after it
// publishes them to the block.
__device__ __forceinline__ void copy16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void copies_done() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Copies n bytes at src into shared memory `tile` (16-byte aligned, room for n + 15 bytes) so
// that src[0] lands at tile + src % 16 (the return value): the 16-byte-aligned middle moves in
// 16-byte copies, the ragged ends byte by byte. The block's threads share the work; call
// copies_done() and __syncthreads() before reading the tile. `in_vram`: src is device memory, read
// by asynchronous copies; mapped host memory is read by plain 16-byte loads (cp.async from host
// memory keeps fewer PCIe reads in flight, so it is slower there: docs/BENCHMARKS.md).
__device__ const u8* stage_bytes(const u8* src, long long n, u8* tile, bool in_vram) {
    const u64 a = reinterpret_cast<u64>(src), end = a + n;
    const u64 lo = (a + 15) & ~15ull, hi = end & ~15ull;
    u8* dst = tile + (a & 15);
    if (lo >= hi) {
        for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
        return dst;
    }
    const long long head = (long long)(lo - a), body = (long long)(hi - lo) / 16, tail = (long long)(end - hi);
    const uint4* s4 = reinterpret_cast<const uint4*>(lo);
    uint4* d4 = reinterpret_cast<uint4*>(dst + head);  // 16-byte aligned: tile + 16 * (a % 16 != 0)
    if (in_vram)
        for (long long i = threadIdx.x; i < body; i += blockDim.x) copy16(d4 + i, s4 + i);
    else
#pragma unroll 4
        for (long long i = threadIdx.x; i < body; i += blockDim.x) d4[i] = s4[i];
    for (long long i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
    for (long long i = threadIdx.x; i < tail; i += blockDim.x) dst[head + 16 * body + i] = src[head + 16 * body + i];
    return dst;
}

// A bf16 vector of n_sub * 32 values into shared memory as it is (two values a word), sub-block j
// at word VWORDS * j: lanes reading "their" sub-block's k-th word then hit 32 different banks (17
// is odd), and each load brings two values.
constexpr int VWORDS = 17;
__device__ __forceinline__ void stage_vector(const __nv_bfloat16* src, int n, unsigned* v) {
    const unsigned* s = reinterpret_cast<const unsigned*>(src);  // n even, src 4-byte aligned
    for (int i = threadIdx.x; i < n / 2; i += blockDim.x) v[(i >> 4) * VWORDS + (i & 15)] = s[i];
}

// One row of n_sub 32-weight sub-blocks (GGML blocks from `row`) dotted with the staged vector v;
// every lane gets the warp's sum. Weights are rounded to bf16 first, as the twin's dequant does.
template <int TYPE>
__device__ __forceinline__ float row_dot(const u8* row, int n_sub, const unsigned* v) {
    constexpr int PER = Fmt<TYPE>::QK / 32;
    float acc = 0.f;
    for (int j = threadIdx.x & 31; j < n_sub; j += 32) {
        float w[32];
        sub_block<TYPE>(row + (j / PER) * Fmt<TYPE>::BYTES, j % PER, w);
        const unsigned* vj = v + VWORDS * j;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const unsigned pair = vj[k];  // values 2k (low half) and 2k + 1 (high half)
            acc = fmaf(bf16r(w[2 * k]), __uint_as_float(pair << 16), acc);
            acc = fmaf(bf16r(w[2 * k + 1]), __uint_as_float(pair & 0xFFFF0000u), acc);
        }
    }
    return warp_sum(acc);
}

// Two rows (gate's and up's) dotted with the same staged vector: its words read once into
// registers for both. Each sum runs in row_dot's order, so each equals row_dot's.
template <int TYPE>
__device__ __forceinline__ void row_dot_pair(const u8* row0, const u8* row1, int n_sub, const unsigned* v,
                                             float* dot0, float* dot1) {
    constexpr int PER = Fmt<TYPE>::QK / 32;
    float acc0 = 0.f, acc1 = 0.f;
    for (int j = threadIdx.x & 31; j < n_sub; j += 32) {
        unsigned pairs[16];
        const unsigned* vj = v + VWORDS * j;
#pragma unroll
        for (int k = 0; k < 16; ++k) pairs[k] = vj[k];
        float w[32];
        sub_block<TYPE>(row0 + (j / PER) * Fmt<TYPE>::BYTES, j % PER, w);
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            acc0 = fmaf(bf16r(w[2 * k]), __uint_as_float(pairs[k] << 16), acc0);
            acc0 = fmaf(bf16r(w[2 * k + 1]), __uint_as_float(pairs[k] & 0xFFFF0000u), acc0);
        }
        sub_block<TYPE>(row1 + (j / PER) * Fmt<TYPE>::BYTES, j % PER, w);
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            acc1 = fmaf(bf16r(w[2 * k]), __uint_as_float(pairs[k] << 16), acc1);
            acc1 = fmaf(bf16r(w[2 * k + 1]), __uint_as_float(pairs[k] & 0xFFFF0000u), acc1);
        }
    }
    *dot0 = warp_sum(acc0);
    *dot1 = warp_sum(acc1);
}

// Activations as 8-bit integers, Q8_WORDS words a 32-value sub-block (q8_dot.cuh says the
// layout): one warp a sub-block. x [n_sub * 32] bf16 -> out [n_sub * Q8_WORDS] words.
extern "C" __global__ void quantize_q8(const __nv_bfloat16* __restrict__ x, long long n_sub,
                                       unsigned* __restrict__ out) {
    const long long j = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n_sub) return;  // whole warps: the shuffles in quantize_run see all 32 lanes
    quantize_run(__bfloat162float(x[32 * j + (threadIdx.x & 31)]), out + Q8_WORDS * j);
}

// n_sub quantized sub-blocks (Q8_WORDS words each, 16-byte aligned) into shared memory as they are.
__device__ __forceinline__ void stage_q8(const unsigned* src, int n_sub, unsigned* v) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(v);
    for (int i = threadIdx.x; i < n_sub * (Q8_WORDS / 4); i += blockDim.x) copy16(d + i, s + i);
}

// Shared words of a staged vector of n values: quantized, or bf16 pairs at VWORDS a sub-block.
template <int TYPE>
__host__ __device__ constexpr int vector_words(int n) { return n / 32 * (Q8Dot<TYPE>::ok ? Q8_WORDS : VWORDS); }

__host__ __device__ constexpr long long tile_room(long long bytes) { return ((bytes + 15) & ~15ll) + 16; }

// grid (ceil(F / rows), P), rows <= warps a block; shared: 2 * tile_room(rows * row_bytes) +
// 4 * vector_words<TYPE>(D). xq: x quantized (integer path; the float path reads x).
template <int TYPE>
__global__ void moe_gate_up(const __nv_bfloat16* __restrict__ x, const unsigned* __restrict__ xq,
                            const long long* __restrict__ picks, int A, const long long* __restrict__ slot_of,
                            const long long* __restrict__ host_offset, u64 slots, long long slot_bytes, u64 arena,
                            int D, int F, long long row_bytes, int rows, __nv_bfloat16* __restrict__ act) {
    extern __shared__ __align__(16) u8 smem[];
    const int p = blockIdx.y, t = p / A, f0 = blockIdx.x * rows, n = min(rows, F - f0);
    const int warp = threadIdx.x >> 5;
    const long long room = tile_room(rows * row_bytes);
    const long long e = picks[p];
    if (e < 0) return;  // a pick the host's cores compute (cpu_handover.cu): its act row is never read
    const bool in_vram = slot_of[e] >= 0;
    const u8* expert = expert_at(e, slot_of, host_offset, slots, slot_bytes, arena);
    const u8* gate = stage_bytes(expert + f0 * row_bytes, n * row_bytes, smem, in_vram);
    const u8* up = stage_bytes(expert + (F + f0) * row_bytes, n * row_bytes, smem + room, in_vram);
    unsigned* v = reinterpret_cast<unsigned*>(smem + 2 * room);
    if constexpr (Q8Dot<TYPE>::ok) stage_q8(xq + (long long)t * vector_words<TYPE>(D), D / 32, v);
    else stage_vector(x + (long long)t * D, D, v);
    copies_done();
    __syncthreads();
    if (warp < n) {
        float g, u;
        if constexpr (Q8Dot<TYPE>::ok) {  // the integer path: q8_rows.cuh's dots, one vector
            const u8* rows[2] = {gate + warp * row_bytes, up + warp * row_bytes};
            float dots[2][1];
            q8_row_dots<TYPE, 2, 1>(rows, D / 32, v, 0, 1, dots);
            g = dots[0][0], u = dots[1][0];
        } else
            row_dot_pair<TYPE>(gate + warp * row_bytes, up + warp * row_bytes, D / 32, v, &g, &u);
        g = bf16r(g);
        u = bf16r(u);
        if ((threadIdx.x & 31) == 0) act[(long long)p * F + f0 + warp] = __float2bfloat16_rn(bf16r(g / (1.f + expf(-g))) * u);
    }
}

// grid (ceil(D / rows), T); shared: A * tile_room(rows * row_bytes) + 4 * A * vector_words<TYPE>(F) +
// rows * A * 4. aq: act quantized (integer path; the float path reads act).
// Every pick's tile and vector are staged at once; the block's warps then take the rows x picks
// dots in turn (no barrier between picks), and each row's weighted sum runs over the picks in
// order, as the twin's does.
template <int TYPE>
__global__ void moe_down(const __nv_bfloat16* __restrict__ act, const unsigned* __restrict__ aq,
                         const long long* __restrict__ picks, const float* __restrict__ weights, int A,
                         const long long* __restrict__ slot_of, const long long* __restrict__ host_offset, u64 slots,
                         long long slot_bytes, u64 arena, int D, int F, long long row_bytes, long long down_offset,
                         int rows, __nv_bfloat16* __restrict__ out) {
    extern __shared__ __align__(16) u8 smem[];
    const int t = blockIdx.y, d0 = blockIdx.x * rows, n = min(rows, D - d0);
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const long long room = tile_room(rows * row_bytes);
    const int vwords = vector_words<TYPE>(F);
    unsigned* v = reinterpret_cast<unsigned*>(smem + A * room);
    float* partial = reinterpret_cast<float*>(v + A * vwords);  // [rows, A]
    __shared__ u64 tile_src[MAX_PICKS];  // each pick's first row of the tile: looked up at once, not pick by pick
    __shared__ bool tile_in_vram[MAX_PICKS];
    if (threadIdx.x < A) {
        const long long e = picks[t * A + threadIdx.x];  // < 0: the host's cores compute it, it adds nothing here
        tile_in_vram[threadIdx.x] = e >= 0 && slot_of[e] >= 0;
        tile_src[threadIdx.x] = e < 0 ? 0ull
                                : reinterpret_cast<u64>(expert_at(e, slot_of, host_offset, slots, slot_bytes, arena))
                                  + down_offset + d0 * row_bytes;
    }
    __syncthreads();
    for (int a = 0; a < A; ++a) {  // every pick's tile and vector in flight at once
        if (tile_src[a] == 0ull) continue;
        stage_bytes(reinterpret_cast<const u8*>(tile_src[a]), n * row_bytes, smem + a * room, tile_in_vram[a]);
        if constexpr (Q8Dot<TYPE>::ok) stage_q8(aq + ((long long)t * A + a) * vwords, F / 32, v + a * vwords);
        else stage_vector(act + ((long long)t * A + a) * F, F, v + a * vwords);
    }
    copies_done();
    __syncthreads();
    for (int k = warp; k < n * A; k += warps) {  // dot k: row k / A, pick k % A
        const int r = k / A, a = k % A;
        if (tile_src[a] == 0ull) {
            if ((threadIdx.x & 31) == 0) partial[r * A + a] = 0.f;
            continue;
        }
        const u8* row = smem + a * room + (tile_src[a] & 15) + r * row_bytes;  // where stage_bytes put it
        float y;
        if constexpr (Q8Dot<TYPE>::ok) {
            float dots[1][1];
            q8_row_dots<TYPE, 1, 1>(&row, F / 32, v + a * vwords, 0, 1, dots);
            y = dots[0][0];
        } else y = row_dot<TYPE>(row, F / 32, v + a * vwords);
        y = bf16r(y);
        if ((threadIdx.x & 31) == 0) partial[r * A + a] = y;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        float acc = 0.f;
        for (int a = 0; a < A; ++a) acc = fmaf(bf16r(weights[(long long)t * A + a]), partial[r * A + a], acc);
        out[(long long)t * D + d0 + r] = __float2bfloat16_rn(acc);
    }
}

#define MOE_INSTANTIATE(TYPE)                                                                             \
    template __global__ void moe_gate_up<TYPE>(const __nv_bfloat16*, const unsigned*, const long long*, int,    \
                                               const long long*, const long long*, u64, long long, u64, int, int, \
                                               long long, int, __nv_bfloat16*);                               \
    template __global__ void moe_down<TYPE>(const __nv_bfloat16*, const unsigned*, const long long*, const float*, \
                                            int, const long long*, const long long*, u64, long long, u64, int,   \
                                            int, long long, long long, int, __nv_bfloat16*);
GGML_CUDA_TYPES(MOE_INSTANTIATE)
