// Dequantize GGML blocks to bf16, one thread per 32-weight sub-block.
//
// Template argument: the ggml type id (F32 = 0, F16 = 1, Q8_0 = 8, Q4_K = 12, ...; GGML_CUDA_TYPES).
// The source is `groups` runs of whole blocks (one expert's matrix each), `group_stride` bytes
// apart; dst is the runs' values back to back. Contiguous data: one group, stride 0.
// n_sub = 32-weight sub-blocks in all (unused: the grid says it); sub_per_group = sub-blocks of one run. With group_ptr
// (device uint64, one address per output run), run g is read from group_ptr[g] + ptr_offset
// instead: decode gathers the experts a token picked, each from a VRAM cache slot or straight
// from the pinned host arena through its device mapping, in one launch and with no host sync.
// Blocks are decoded by ggml_blocks.cuh (rounding exactly like the torch twin), then rounded to
// nearest-even bf16.
#include "ggml_blocks.cuh"

// 32 fp32 values -> 32 bf16 in 4 16-byte stores.
__device__ __forceinline__ void store32(__nv_bfloat16* dst, const float* v) {
    uint4* out = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 a = __floats2bfloat162_rn(v[8 * i + 0], v[8 * i + 1]);
        __nv_bfloat162 b = __floats2bfloat162_rn(v[8 * i + 2], v[8 * i + 3]);
        __nv_bfloat162 c = __floats2bfloat162_rn(v[8 * i + 4], v[8 * i + 5]);
        __nv_bfloat162 d = __floats2bfloat162_rn(v[8 * i + 6], v[8 * i + 7]);
        uint4 w;
        w.x = *reinterpret_cast<unsigned*>(&a);
        w.y = *reinterpret_cast<unsigned*>(&b);
        w.z = *reinterpret_cast<unsigned*>(&c);
        w.w = *reinterpret_cast<unsigned*>(&d);
        out[i] = w;
    }
}

// grid (x, groups): blockIdx.y is the run, the x blocks stride over its sub-blocks (no 64-bit
// division a sub-block, which cost more instructions than decoding its 32 weights' indices).
template <int TYPE>
__global__ void dequant_bf16(const u8* __restrict__ src, __nv_bfloat16* __restrict__ dst, long long n_sub,
                             long long sub_per_group, long long group_stride,
                             const unsigned long long* __restrict__ group_ptr, long long ptr_offset) {
    const int per_block = Fmt<TYPE>::QK / 32;
    const long long run = blockIdx.y;
    const u8* base = group_ptr ? reinterpret_cast<const u8*>(group_ptr[run] + ptr_offset) : src + run * group_stride;
    __nv_bfloat16* out = dst + run * sub_per_group * 32;
    for (long long in_group = blockIdx.x * (long long)blockDim.x + threadIdx.x; in_group < sub_per_group;
         in_group += (long long)gridDim.x * blockDim.x) {
        float v[32];
        sub_block<TYPE>(base + (in_group / per_block) * Fmt<TYPE>::BYTES, (int)(in_group % per_block), v);
        store32(out + in_group * 32, v);
    }
}

// Explicit instantiations: what nvcc's compile check builds and NVRTC's name expressions find.
#define DEQUANT_INSTANTIATE(TYPE)                                                                        \
    template __global__ void dequant_bf16<TYPE>(const u8*, __nv_bfloat16*, long long, long long, long long, \
                                                const unsigned long long*, long long);
GGML_CUDA_TYPES(DEQUANT_INSTANTIATE)
