// A decode layer's routed experts shared with the host's cores, from inside the GPU's stream: no
// host sync and no host launch a layer, so a captured decode graph replays it as it is.
//
// Per layer of a gathered pass (stage/experts/handover.py says the protocol, cpu_handover.py launches these):
//   handover_send  decides which picks the host computes: experts not resident in VRAM, a share of
//                  them by a running carry (so the share holds across layers and steps, one pick at a
//                  time); writes their ids, the rows' weights and the rows (fp32) into the mailbox in
//                  mapped host memory, then the request number; returns the GPU's picks with the
//                  host's set to -1 (moe_decode.cu skips those).
//   (the GPU computes its own picks meanwhile: moe_decode.cu)
//   handover_add   waits until the host's done number equals the request, then adds the host's sums.
// A layer where the host takes nothing writes nothing to the host and waits for nothing.
// A few-row prompt pass that streams whole layers (handover_rows + handover_send_fixed, below) gives
// the host a fixed set of each layer's streamed experts instead, and waits for its sums the same way.
//
// Shapes: T rows, A picks a row, P = T * A picks (pick p = t * A + a), D hidden, E experts a layer.
// Ordering: the mailbox's payload is written and fenced (__threadfence_system) before the request
// number; the host writes its sums before the done number (x86 keeps stores in order) and the
// waiting block reads them only after it saw that number, with loads that skip the caches.
#include <cuda_bf16.h>

constexpr int MAX_EXPERTS = 4096;  // handover.py's MAX_EXPERTS: the build checks
constexpr int ON_GPU = 1, ON_HOST = 2;

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Thread 0, once the block's payload is written and fenced: the layer's host picks for
// handover_add, and where there are any the meta, fenced, then the next request number.
__device__ __forceinline__ void post_request(int n, int T, int A, int layer, long long* counter, int* n_host,
                                             int* meta, volatile long long* request) {
    *n_host = n;
    if (n > 0) {
        meta[0] = T, meta[1] = A, meta[2] = layer, meta[3] = n;
        __threadfence_system();
        const long long c = *counter + 1;
        *counter = c;
        *request = c;
    }
}

// handover_send's argument, passed by value: a layer's tensors and sizes, then the mailbox's and
// the device state's addresses (fixed for the hand-over's life). cpu_handover.py's SEND_ARGS lays
// it out field by field (tests/test_nvrtc_compile.py compiles its offsets against this struct).
struct HandoverSend {
    const long long* experts;  // [P]
    const float* weights;      // [P]
    const __nv_bfloat16* h;    // [T, D] bf16
    const long long* slot_of;  // [E]: the layer's row of the expert cache (-1: not resident)
    long long* gpu_picks;      // out [P]: the GPU's picks, the host's -1
    const float* share;        // the fraction of misses the host takes (mapped host memory)
    float* carry;              // the running remainder (device, kept between launches)
    long long* counter;        // the last request number (device)
    int* n_host;               // this layer's host picks, for handover_add (device)
    float* h_host;             // the mailbox: [T, D] fp32
    int* picks_host;           // [P]: the host's experts, -1 elsewhere
    float* w_host;             // [P]
    int* meta;                 // [4]: T, A, local layer, host picks
    volatile long long* request;
    int T, A, D, E, layer;
};

// grid 1, block 512 (any multiple of 32): the fields of HandoverSend above.
extern "C" __global__ void handover_send(const HandoverSend args) {
    const long long* __restrict__ experts = args.experts;
    const float* __restrict__ weights = args.weights;
    const __nv_bfloat16* __restrict__ h = args.h;
    const long long* __restrict__ slot_of = args.slot_of;
    long long* __restrict__ gpu_picks = args.gpu_picks;
    const float* __restrict__ share = args.share;
    float* carry = args.carry;
    long long* counter = args.counter;
    int* n_host = args.n_host;
    float* h_host = args.h_host;
    int* picks_host = args.picks_host;
    float* w_host = args.w_host;
    int* meta = args.meta;
    volatile long long* request = args.request;
    const int T = args.T, A = args.A, D = args.D, E = args.E, layer = args.layer;
    __shared__ unsigned char side[MAX_EXPERTS];
    __shared__ int n;
    const int P = T * A;
    for (int e = threadIdx.x; e < E; e += blockDim.x) side[e] = 0;
    __syncthreads();
    if (threadIdx.x == 0) {  // in pick order: the carry makes the same choices a serial host would
        float c = *carry;
        const float f = *share;
        int count = 0;
        for (int p = 0; p < P; ++p) {
            const long long e = experts[p];
            if (side[e] != 0) continue;  // an expert two rows picked goes one way
            if (slot_of[e] >= 0) {
                side[e] = ON_GPU;
                continue;
            }
            c += f;
            if (c >= 1.f) {
                c -= 1.f;
                side[e] = ON_HOST;
                ++count;
            } else side[e] = ON_GPU;
        }
        *carry = c;
        n = count;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const long long e = experts[p];
        const bool host = side[e] == ON_HOST;
        gpu_picks[p] = host ? -1 : e;
        if (n > 0) {
            picks_host[p] = host ? (int)e : -1;
            w_host[p] = weights[p];
        }
    }
    if (n > 0)
        for (long long i = threadIdx.x; i < (long long)T * D; i += blockDim.x) h_host[i] = __bfloat162float(h[i]);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) post_request(n, T, A, layer, counter, n_host, meta, request);
}

// A prompt pass's rows (HostPrefillHelper, stage/experts/host_prompt.py): the host takes a fixed set
// of each layer's streamed experts rather than a share of the misses, and a chunk of rows is too
// many for one block, so the rows go first, from many blocks:
// grid (any), block 256: h [n] bf16 into the mailbox's h_host [n] fp32, each thread's writes
// fenced before it ends (handover_send_fixed, next in the stream, then bumps the request).
extern "C" __global__ void handover_rows(const __nv_bfloat16* __restrict__ h, float* h_host, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        h_host[i] = __bfloat162float(h[i]);
    __threadfence_system();
}

// grid 1, block 512. The picks of the experts host_of [E] marks (1) go to the host: picks_host [P]
// (their ids, -1 elsewhere), w_host [P], meta (T, A, local layer, host picks), then the request
// where there is any; n_host for handover_add. The GPU computes its own part of the layer apart
// (stage/experts/parts.py), so no GPU picks come back.
extern "C" __global__ void handover_send_fixed(const long long* __restrict__ experts,
                                               const float* __restrict__ weights,
                                               const unsigned char* __restrict__ host_of, int T, int A, int layer,
                                               long long* counter, int* n_host, int* picks_host, float* w_host,
                                               int* meta, volatile long long* request) {
    __shared__ int n;
    if (threadIdx.x == 0) n = 0;
    __syncthreads();
    int mine = 0;
    for (int p = threadIdx.x; p < T * A; p += blockDim.x) {
        const long long e = experts[p];
        const bool host = host_of[e] != 0;
        picks_host[p] = host ? (int)e : -1;
        w_host[p] = weights[p];
        mine += host;
    }
    if (mine) atomicAdd(&n, mine);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) post_request(n, T, A, layer, counter, n_host, meta, request);
}

// grid (<= 16 blocks), block 256. out [T * D] bf16 (the GPU's picks' sums) += out_host [T * D] fp32
// (the host's), once done == counter. A host that does not answer within timeout_ns sets *status
// to 1 and leaves out as it is; later waits return at once, and the stage's next arm() detaches the
// hand-over (stage/experts/handover.py).
extern "C" __global__ void handover_add(__nv_bfloat16* __restrict__ out, const float* out_host,
                                        const volatile long long* done, const long long* __restrict__ counter,
                                        const int* __restrict__ n_host, volatile int* status, long long timeout_ns,
                                        long long n_elems) {
    __shared__ int answered;
    if (*n_host == 0) return;  // the whole grid returns: nothing was asked of the host
    if (*status != 0) return;  // a wait timed out before: the hand-over is broken, waiting again would only stall
    if (threadIdx.x == 0) {
        const long long want = *counter;
        const unsigned long long start = global_ns();
        answered = 1;
        while (*done != want) {
            if (global_ns() - start > (unsigned long long)timeout_ns) {
                *status = 1;
                answered = 0;
                break;
            }
            __nanosleep(200);
        }
        __threadfence_system();
    }
    __syncthreads();
    if (!answered) return;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n_elems; i += (long long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(__bfloat162float(out[i]) + __ldcv(out_host + i));
}
