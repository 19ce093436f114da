"""Dequantization of GGML blocks into float32 torch tensors.

The formats the experts and dense weights of real Qwen3 GGUFs use (F32, F16, BF16, Q8_0, Q4_0,
Q4_K, Q5_K, Q6_K) are written here in torch, vectorized over blocks, so the same code runs on
the CPU and on a GPU (the twin of the CUDA kernels). The remaining supported formats go through
`gguf.quants` on the host. Tests compare every format with `gguf.quants` block by block.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType

from strata_mgpu.quant.formats import block_format

Q = GGMLQuantizationType

# Shape legend: N = blocks, B = bytes per block, W = weights per block.


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """fp16 word at byte `at` of each block, as float32: [N, B] uint8 -> [N, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)  # [N, 1]
    q = b[:, 2:34].contiguous().view(torch.int8).float()  # [N, 32]
    return d * q


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    qs = b[:, 2:18]  # [N, 16]: low nibbles are weights 0..15, high nibbles 16..31
    q = torch.cat([qs & 0xF, qs >> 4], dim=1).float() - 8.0  # [N, 32]
    return d * q


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K packed 6-bit scales and mins: [N, 12] uint8 -> two [N, 8] float32.

    Sub-blocks 0..3 keep their 6 bits in bytes 0..3 (scale) and 4..7 (min); sub-blocks 4..7 keep
    the low 4 bits in bytes 8..11 and the high 2 bits in the top bits of bytes 0..7.
    """
    s = scales.to(torch.int32)
    lo_sc = s[:, 0:4] & 63
    lo_mn = s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    hi_mn = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], 1).float(), torch.cat([lo_mn, hi_mn], 1).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])  # [N, 8]
    qs = b[:, 16:144].reshape(n, 4, 32)  # 4 groups of 64 weights: low nibbles then high nibbles
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(n, 8, 32).float()  # [N, 8 sub-blocks, 32]
    return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]  # [N, 32]: bit k of byte l is the 5th bit of weight l of sub-block k
    qs = b[:, 48:176].reshape(n, 4, 32)
    low = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(n, 8, 32)
    bits = torch.arange(8, device=b.device, dtype=torch.uint8)
    high = (qh[:, None, :] >> bits[None, :, None]) & 1  # [N, 8, 32]
    q = (low | (high << 4)).float()
    return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)  # two halves of 128 weights
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(b, 208)  # [N, 1]
    # Within a half: weights 0..31 = ql[0:32] low | qh bits 0-1; 32..63 = ql[32:64] low | bits 2-3;
    # 64..95 = ql[0:32] high | bits 4-5; 96..127 = ql[32:64] high | bits 6-7.
    lo = torch.cat([ql[:, :, 0:32] & 0xF, ql[:, :, 32:64] & 0xF, ql[:, :, 0:32] >> 4, ql[:, :, 32:64] >> 4],
                   dim=2)  # [N, 2, 128]
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).repeat_interleave(32)
    hi = (qh.repeat(1, 1, 4) >> shifts) & 3  # [N, 2, 128]
    q = (lo | (hi << 4)).float() - 32.0
    scale = sc.repeat_interleave(16, dim=2)  # 16 weights share a scale: [N, 2, 128]
    return (d[:, :, None] * scale * q).reshape(n, 256)


_TORCH_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}


def dequantize_rows(raw: torch.Tensor, ggml_type: GGMLQuantizationType, row_len: int) -> torch.Tensor:
    """[R, row_bytes] uint8 on any device -> [R, row_len] float32 on that device (torch paths only)."""
    fmt = block_format(ggml_type)
    rows = raw.shape[0]
    assert raw.dtype == torch.uint8 and raw.shape[1] == fmt.row_bytes(row_len), (raw.shape, fmt.name, row_len)
    if ggml_type == Q.F32:
        return raw.contiguous().view(torch.float32).reshape(rows, row_len)
    if ggml_type == Q.F16:
        return raw.contiguous().view(torch.float16).float().reshape(rows, row_len)
    if ggml_type == Q.BF16:
        return raw.contiguous().view(torch.bfloat16).float().reshape(rows, row_len)
    kernel = _TORCH_KERNELS[ggml_type]
    blocks = raw.reshape(-1, fmt.type_size)
    return kernel(blocks).reshape(rows, row_len)


def has_torch_kernel(ggml_type: GGMLQuantizationType) -> bool:
    return ggml_type in _TORCH_KERNELS or ggml_type in (Q.F32, Q.F16, Q.BF16)


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...],
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Host bytes of a tensor ([..., row_bytes] uint8) -> float32 tensor of `shape` on `device`
    (the torch formats are dequantized there; the others on the host, then moved)."""
    fmt = block_format(ggml_type)
    row_len = shape[-1]
    flat = np.array(raw, dtype=np.uint8).reshape(-1, fmt.row_bytes(row_len))  # owned copy: memmaps are read-only
    if has_torch_kernel(ggml_type):
        out = dequantize_rows(torch.from_numpy(flat).to(device), ggml_type, row_len)
    else:
        out = torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(flat, ggml_type), dtype=np.float32))
    return out.to(device).reshape(shape)
