"""A GPU stage's dense projections straight from their GGML blocks (`cuda_src/dense_decode.cu`),
and the torch twin they are held to.

A decode step at batch 1 reads every dense weight once: bf16 copies take 2 bytes a weight, the
file's own Q8_0 1.06, Q4_K 0.56. `dense_q8` multiplies the blocks as they are, its input
quantized to 8 bits, for the integer types of `q8_dot.cuh` (`Q8_DOT_TYPES`).

`DeviceDense` takes up to `rows_a_launch` rows through one launch of `dense_q8`; more rows
(prompts) dequantize the matrix into transient bf16 slices for a GEMM. A second launch would read
W again, and at 8 rows the vectors' shared-memory loads, not W's bytes, already bound a launch;
a prompt's GEMM is bound by its arithmetic. The twin of the whole: bf16 weights and torch's GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.experts import CudaKernels, q8_values
from strata_mgpu.kernels.q8 import Q8_DOT_TYPES, Q8_WORDS
from strata_mgpu.model.decoder import DenseMatmul
from strata_mgpu.model.weights import BlockMatrix, Matrix
from strata_mgpu.quant.dequant import dequantize_rows
from strata_mgpu.quant.formats import block_format

DENSE_FILE = "dense_decode.cu"
W_ROWS_A_WARP = (1, 2, 4)  # dense_q8's R: rows of W a warp takes (instantiated for each)
DENSE_EXPRS = tuple(f"dense_q8<{int(t)}, {r}>" for t in sorted(Q8_DOT_TYPES) for r in W_ROWS_A_WARP)
DENSE_THREADS = 256  # 8 warps, a warp R rows of W
# blocks a launch keeps at least, a multiprocessor's worth twice over, when it gives a warp more
# rows of W (fewer warps: each one's loads wait their latency with fewer others beside them)
BLOCKS_A_MULTIPROCESSOR = 2
DENSE_MAX_ROWS = 8  # dense_decode.cu's DENSE_MAX_ROWS: rows of x a launch takes
# x quantized, staged in shared memory: dense_q8 has no static shared memory, so all of the 48 KiB a
# block gets without opting in (8 rows of a 4,096-wide x)
DENSE_SHARED_BYTES = 48 * 1024
DENSE_SCRATCH_VALUES = 16 << 20  # a prompt's transient bf16 copy of W, at most this many values at a time


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


def w_rows_a_warp(x_rows: int, n: int, multiprocessors: int) -> int:
    """dense_q8's R: one where x has one row (bytes bound it, more warps keep more in flight); else the
    most, up to x_rows, that leaves the grid BLOCKS_A_MULTIPROCESSOR blocks a multiprocessor."""
    warps = DENSE_THREADS // 32
    fits = [r for r in W_ROWS_A_WARP
            if r <= x_rows and -(-n // (warps * r)) >= BLOCKS_A_MULTIPROCESSOR * multiprocessors]
    return max(fits, default=1)


def keeps_blocks(ggml_type: GGMLQuantizationType, k: int) -> bool:
    """Where `dense_q8` takes a projection of this type and width."""
    fmt = block_format(ggml_type)
    return ggml_type in Q8_DOT_TYPES and k % fmt.block_size == 0 and rows_a_launch(k) > 0


def dense_q8(kernels: CudaKernels, x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType,
             xq: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] bf16 times W, raw [N, row_bytes] uint8 blocks of an integer type in device memory ->
    [T, N] bf16: one launch every DENSE_MAX_ROWS rows of x. `xq`: x already quantized."""
    t, k = x.shape
    n, row_bytes = raw.shape
    fmt = block_format(ggml_type)
    per_launch = rows_a_launch(k)
    if not keeps_blocks(ggml_type, k) or row_bytes != fmt.row_bytes(k):
        raise ValueError(f"dense_q8 takes {', '.join(sorted(q.name for q in Q8_DOT_TYPES))} rows of K = {k}; "
                         f"got {ggml_type.name} rows of {row_bytes} bytes")
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and raw.is_contiguous() and raw.dtype == torch.uint8
    out = torch.empty(t, n, dtype=torch.bfloat16, device=x.device)
    if t == 0 or n == 0:
        return out  # nothing to launch (a grid of no blocks is an error)
    if xq is None:
        xq = kernels._quantize_q8(x)  # [T, K / 32 * Q8_WORDS]
    assert xq.shape == (t, k // 32 * Q8_WORDS)
    warps = DENSE_THREADS // 32
    for t0 in range(0, t, per_launch):
        rows = min(per_launch, t - t0)
        r = w_rows_a_warp(rows, n, kernels.multiprocessors)
        fn = nvrtc.kernel(DENSE_FILE, f"dense_q8<{int(ggml_type)}, {r}>", DENSE_EXPRS, kernels.device)
        nvrtc.launch(fn, -(-n // (warps * r)), DENSE_THREADS,
                     (xq[t0].data_ptr(), np.int32(rows), np.int32(k), raw.data_ptr(), np.int64(row_bytes),
                      np.int32(n), out[t0].data_ptr()), kernels.device,
                     shared_mem=rows * (k // 32) * Q8_WORDS * 4)
    kernels.paths.ran("dense", "q8")
    return out


class DeviceDense(DenseMatmul):
    """A GPU stage's `DenseMatmul`: float projections by torch's GEMM; blocks by `dense_q8` up to
    `rows_a_launch` rows, else dequantized slice by slice. Every call is capturable in a CUDA graph.
    `scratch_bytes`: the most a copy holds at once (the VRAM plan counts it)."""

    scratch_bytes = 2 * DENSE_SCRATCH_VALUES  # bf16

    def __init__(self, kernels: CudaKernels):
        self.kernels = kernels
        for expr in DENSE_EXPRS:  # compiled and loaded now: a decode graph's capture may be its first use
            nvrtc.kernel(DENSE_FILE, expr, DENSE_EXPRS, kernels.device)

    def __call__(self, x: torch.Tensor, w: Matrix) -> torch.Tensor:
        return self.many(x, (w,))[0]

    def many(self, x: torch.Tensor, ws: Sequence[Matrix]) -> list[torch.Tensor]:
        x = x.contiguous()
        xq: torch.Tensor | None = None  # x quantized once for every dense_q8 of the call
        out = []
        for w in ws:
            if not isinstance(w, BlockMatrix):
                out.append(x @ w.T)
            elif x.shape[0] <= rows_a_launch(w.k):
                if xq is None and x.shape[0]:
                    xq = self.kernels._quantize_q8(x)
                out.append(dense_q8(self.kernels, x, w.raw, w.ggml_type, xq))
            else:
                out.append(self._dequantized_product(x, w))
        return out

    def _dequantized_product(self, x: torch.Tensor, w: BlockMatrix) -> torch.Tensor:
        self.kernels.paths.ran("dense", "dequant")
        rows = max(1, DENSE_SCRATCH_VALUES // w.k)
        parts = []
        for r0 in range(0, w.n, rows):
            part = w.raw[r0:r0 + rows]
            wf = torch.empty(part.shape[0], w.k, dtype=x.dtype, device=x.device)
            self.kernels.dequant(part, w.ggml_type, 1, part.shape[0] * w.k, 0, wf.view(-1))
            parts.append(x @ wf.T)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
