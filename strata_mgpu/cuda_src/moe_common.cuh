// What the routed-expert kernels share (moe_decode.cu: a decode step's picks one by one;
// moe_grouped.cu: a short prompt's picks expert by expert).
//
// Expert e's bytes: slots + slot_of[e] * slot_bytes when slot_of[e] >= 0 (a VRAM cache slot), else
// arena + host_offset[e] (the pinned host arena, read through its device mapping); the tables are
// the layer's rows of the expert cache's. An expert is [gate | up | down], each matrix row-major in
// whole GGML blocks: gate and up F rows of D weights, down D rows of F weights.
#pragma once
#include <cuda_bf16.h>

#include "ggml_blocks.cuh"

typedef unsigned long long u64;

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ const u8* expert_at(long long e, const long long* slot_of, const long long* host_offset,
                                               u64 slots, long long slot_bytes, u64 arena) {
    const long long s = slot_of[e];
    return reinterpret_cast<const u8*>(s >= 0 ? slots + (u64)(s * slot_bytes) : arena + (u64)host_offset[e]);
}
