// A short prompt's routed experts, expert by expert, straight from their GGML blocks.
//
// moe_decode.cu's kernels take a step's picks one at a time: each pick's block reads its expert's
// rows again, which is right for a decode step (a few picks, mostly of distinct experts) and wrong
// for a prompt of tens of rows, whose 8 picks a token land on most of the layer's experts several
// times each (30B-A3B, 16 tokens: 128 picks of ~100 experts; 128 tokens: ~8 picks an expert).
// Here a block owns one expert's rows and dots each of them with the vectors of every pick of that
// expert: each weight is read and unpacked once a batch of up to GROUP_VECTORS picks (once a pass
// where an expert has no more picks than that), not once a pick.
//
// Shapes: T tokens, A picks a token, P = T * A picks (pick p = t * A + a), E experts, D hidden,
// F expert width. The picks sorted by expert: order [P] (pick ids), starts [E + 1] (expert e's
// picks are order[starts[e] .. starts[e + 1])).
//   moe_group_gate_up: xq [T, D / 32 * Q8_WORDS] (x quantized) -> act [P, F] bf16
//   moe_group_down:    aq [P, F / 32 * Q8_WORDS] (act quantized) -> y [P, D] fp32, each value
//                      rounded to bf16 (moe_down's per-pick partial sums)
//   moe_group_combine: y, weights [P] fp32 -> out [T, D] bf16 = sum_a bf16(w_a) y_a, a in order
// Integer types only (q8_dot.cuh's Q8_DOT_TYPES). Every dot is moe_decode.cu's integer one (the
// same inner loop, q8_rows.cuh, over more vectors) and rounds alike, so
// the results equal that path's bit for bit (tests/test_gpu_quant.py checks), and the torch twin
// (kernels/experts.py, moe_fused_reference) holds both.
//
// Block: 32 * warps threads, a warp a weight row (gate_up: a row of gate and the same row of up).
// The picks' vectors come through shared memory nv (<= GROUP_VECTORS) at a time; a warp's lanes
// unpack their sub-blocks of the row once a batch of vectors and dot them with each (q8_rows.cuh). Weights are read from
// global memory (VRAM slots, or the arena's mapping where an expert is not resident: correct, but
// the host path is for decode's kernels).
#include "moe_common.cuh"
#include "q8_rows.cuh"

#ifndef GROUP_VECTORS  // picks' vectors a block holds at once: kernels/moe_grouped.py's, given at compile time
#error "GROUP_VECTORS: compile with -DGROUP_VECTORS=<n> (kernels/moe_grouped.py GROUPED_DEFINES)"
#endif

// Vectors of picks order[j0 .. j0 + n) (row order[j] / div of src, `words` words each, 16-byte
// aligned) into shared memory v, one after another.
__device__ __forceinline__ void stage_picks(const unsigned* src, int words, const long long* order, long long j0,
                                            int n, int div, unsigned* v) {
    const int pieces = words / 4;  // 16-byte pieces a vector (Q8_WORDS is 12)
    for (int i = threadIdx.x; i < n * pieces; i += blockDim.x) {
        const int g = i / pieces, k = i % pieces;
        const long long row = order[j0 + g] / div;
        reinterpret_cast<uint4*>(v + g * words)[k] = reinterpret_cast<const uint4*>(src + row * words)[k];
    }
}

// grid (ceil(F / warps), E); nv (<= GROUP_VECTORS) vectors a batch; shared: nv * D / 32 * Q8_WORDS words.
template <int TYPE>
__global__ void moe_group_gate_up(const unsigned* __restrict__ xq, const long long* __restrict__ order,
                                  const long long* __restrict__ starts, int A, int nv,
                                  const long long* __restrict__ slot_of,
                                  const long long* __restrict__ host_offset, u64 slots, long long slot_bytes,
                                  u64 arena, int D, int F, long long row_bytes, __nv_bfloat16* __restrict__ act) {
    extern __shared__ __align__(16) unsigned vs[];
    const long long e = blockIdx.y, first = starts[e], last = starts[e + 1];
    if (first == last) return;  // no pick of this expert (the whole block leaves, before any barrier)
    const int n_sub = D / 32, words = n_sub * Q8_WORDS, lane = threadIdx.x & 31;
    const int f = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u8* expert = expert_at(e, slot_of, host_offset, slots, slot_bytes, arena);
    const u8* gate = expert + (long long)f * row_bytes;
    const u8* up = expert + (long long)(F + f) * row_bytes;
    for (long long j0 = first; j0 < last; j0 += nv) {
        const int n = (int)min((long long)nv, last - j0);
        __syncthreads();  // the previous batch's vectors are read
        stage_picks(xq, words, order, j0, n, A, vs);
        __syncthreads();
        if (f >= F) continue;  // a ragged last block's spare warps (no return: barriers follow)
        const u8* rows[2] = {gate, up};
        float dots[2][GROUP_VECTORS];
        q8_row_dots<TYPE, 2, GROUP_VECTORS>(rows, n_sub, vs, words, n, dots);
        if (lane == 0)
#pragma unroll
            for (int g = 0; g < GROUP_VECTORS; ++g)
                if (g < n) {
                    const float gs = bf16r(dots[0][g]), us = bf16r(dots[1][g]);
                    act[order[j0 + g] * F + f] = __float2bfloat16_rn(bf16r(gs / (1.f + expf(-gs))) * us);
                }
    }
}

// grid (ceil(D / warps), E); nv (<= GROUP_VECTORS) vectors a batch; shared: nv * F / 32 * Q8_WORDS words.
template <int TYPE>
__global__ void moe_group_down(const unsigned* __restrict__ aq, const long long* __restrict__ order,
                               const long long* __restrict__ starts, int nv, const long long* __restrict__ slot_of,
                               const long long* __restrict__ host_offset, u64 slots, long long slot_bytes, u64 arena,
                               int D, int F, long long row_bytes, long long down_offset, float* __restrict__ y) {
    extern __shared__ __align__(16) unsigned vs[];
    const long long e = blockIdx.y, first = starts[e], last = starts[e + 1];
    if (first == last) return;
    const int n_sub = F / 32, words = n_sub * Q8_WORDS, lane = threadIdx.x & 31;
    const int d = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u8* row = expert_at(e, slot_of, host_offset, slots, slot_bytes, arena) + down_offset + (long long)d * row_bytes;
    for (long long j0 = first; j0 < last; j0 += nv) {
        const int n = (int)min((long long)nv, last - j0);
        __syncthreads();
        stage_picks(aq, words, order, j0, n, 1, vs);
        __syncthreads();
        if (d >= D) continue;
        float dots[1][GROUP_VECTORS];
        q8_row_dots<TYPE, 1, GROUP_VECTORS>(&row, n_sub, vs, words, n, dots);
        if (lane == 0)
#pragma unroll
            for (int g = 0; g < GROUP_VECTORS; ++g)
                if (g < n) y[order[j0 + g] * D + d] = bf16r(dots[0][g]);
    }
}

// A thread an output value: out[t, d] = sum over a, in order, of bf16(weights[t * A + a]) *
// y[t * A + a, d] in fp32 (moe_down's weighted sum), rounded to bf16.
extern "C" __global__ void moe_group_combine(const float* __restrict__ y, const float* __restrict__ weights, int A,
                                             long long n_out, int D, __nv_bfloat16* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out) return;
    const long long t = i / D, d = i % D;
    float acc = 0.f;
    for (int a = 0; a < A; ++a) acc = fmaf(bf16r(weights[t * A + a]), y[(t * A + a) * D + d], acc);
    out[i] = __float2bfloat16_rn(acc);
}

#define MOE_GROUP_INSTANTIATE(TYPE)                                                                              \
    template __global__ void moe_group_gate_up<TYPE>(const unsigned*, const long long*, const long long*, int, int, \
                                                     const long long*, const long long*, u64, long long, u64, int, \
                                                     int, long long, __nv_bfloat16*);                              \
    template __global__ void moe_group_down<TYPE>(const unsigned*, const long long*, const long long*, int,        \
                                                  const long long*, const long long*, u64, long long, u64, int,    \
                                                  int, long long, long long, float*);
Q8_DOT_TYPES(MOE_GROUP_INSTANTIATE)
