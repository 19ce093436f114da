"""Decode's dense projections straight from their GGML blocks (`cuda_src/dense_decode.cu`), and the
torch twin they are held to.

A decode step at batch 1 reads every dense weight once: with bf16 copies that is 2 bytes a weight
(30B-A3B: ~38 MB of attention a layer and a 622 MB head a token); the file's own Q8_0 is 1.06
bytes, Q4_K 0.56. `dense_q8` multiplies the blocks as they are, its input quantized to 8 bits
(`CudaKernels._quantize_q8`), for the integer types of `q8_dot.cuh` (`Q8_DOT_TYPES`).

Not yet wired into the decoder: `tools.bench_kernels` times it against the bf16 GEMM it would
replace, so the gain is measured before the weights' storage changes.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.experts import Q8_DOT_TYPES, Q8_WORDS, CudaKernels, q8_values
from strata_mgpu.quant.dequant import dequantize_rows
from strata_mgpu.quant.formats import block_format

DENSE_FILE = "dense_decode.cu"
DENSE_EXPRS = tuple(f"dense_q8<{int(t)}>" for t in sorted(Q8_DOT_TYPES))
DENSE_THREADS = 256  # 8 warps, a warp a row of W
DENSE_MAX_ROWS = 8  # dense_decode.cu's DENSE_MAX_ROWS: rows of x a launch takes
DENSE_SHARED_BYTES = 46 * 1024  # x quantized, staged in shared memory, under what every card gives a block


def dense_reference(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """The twin: x [T, K] bf16 quantized as the kernel's input is (`q8_values`) times W (raw [N,
    row_bytes] blocks) dequantized in fp32 -> [T, N] bf16."""
    k = x.shape[1]
    w = dequantize_rows(raw, ggml_type, k).to(x.device)  # [N, K] fp32
    return (q8_values(x) @ w.T).bfloat16()


def rows_a_launch(k: int) -> int:
    """Rows of x whose quantized copies fit the kernel's shared memory for a K-wide x (at most
    DENSE_MAX_ROWS); 0 where not one does, or K is not whole 32-value runs."""
    if k < 32 or k % 32:
        return 0
    return min(DENSE_MAX_ROWS, DENSE_SHARED_BYTES // (k // 32 * Q8_WORDS * 4))


def dense_q8(kernels: CudaKernels, x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType
             ) -> torch.Tensor:
    """x [T, K] bf16 (on the device) times W, raw [N, row_bytes] uint8 blocks of an integer type
    in device memory -> [T, N] bf16: one launch every DENSE_MAX_ROWS rows of x (or fewer, where a
    wide x fills the shared memory first)."""
    t, k = x.shape
    n, row_bytes = raw.shape
    fmt = block_format(ggml_type)
    per_launch = rows_a_launch(k)
    if ggml_type not in Q8_DOT_TYPES or k % fmt.block_size or row_bytes != fmt.row_bytes(k) or not per_launch:
        raise ValueError(f"dense_q8 takes {', '.join(sorted(q.name for q in Q8_DOT_TYPES))} rows of K = {k}; "
                         f"got {ggml_type.name} rows of {row_bytes} bytes")
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and raw.is_contiguous() and raw.dtype == torch.uint8
    out = torch.empty(t, n, dtype=torch.bfloat16, device=x.device)
    if t == 0 or n == 0:
        return out  # nothing to launch (a grid of no blocks is an error)
    xq = kernels._quantize_q8(x)  # [T, K / 32 * Q8_WORDS]
    fn = nvrtc.kernel(DENSE_FILE, f"dense_q8<{int(ggml_type)}>", DENSE_EXPRS, kernels.device)
    warps = DENSE_THREADS // 32
    for t0 in range(0, t, per_launch):
        rows = min(per_launch, t - t0)
        nvrtc.launch(fn, -(-n // warps), DENSE_THREADS,
                     (xq[t0].data_ptr(), np.int32(rows), np.int32(k), raw.data_ptr(), np.int64(row_bytes),
                      np.int32(n), out[t0].data_ptr()), kernels.device,
                     shared_mem=rows * (k // 32) * Q8_WORDS * 4)
    kernels.paths.ran("dense", "q8")
    return out
