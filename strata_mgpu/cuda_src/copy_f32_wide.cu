// Copy n4 16-byte vectors (float4: four 4-byte words) from src to dst, grid-stride.
//
// The hand-over between stages: one side is device memory, the other mapped pinned host memory
// read or written through its host address (UVA). A kernel moves these few hundred KB without
// queueing behind the expert uploads on the copy engines, and 16-byte accesses keep the PCIe
// transactions full. Both pointers must be 16-byte aligned.
extern "C" __global__ void copy_f32_wide(const float4* __restrict__ src, float4* __restrict__ dst, long long n4) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
