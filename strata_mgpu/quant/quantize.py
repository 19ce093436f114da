"""Quantization into GGML blocks in torch (any device): Q8_0, the format of a quantized KV cache.

Q8_0's block (34 bytes, 32 values): [d: fp16][q: int8 x 32], x = d * q. Rounded as ggml's
`quantize_row_q8_0_ref`: d = max |x| / 127 (fp32), q = roundf(x * (1 / d)) (ties away from zero;
0 where d is 0), d stored rounded to fp16. tests/test_kv_q8.py holds it to ggml-python byte for
byte; `cuda_src/decode_ops.cu` rounds the same way.
"""

from __future__ import annotations

import torch

Q8_BLOCK = 32  # values a block
Q8_BYTES = 34  # bytes a block: fp16 d, then 32 int8


def q8_0_row_bytes(n: int) -> int:
    assert n % Q8_BLOCK == 0, f"a Q8_0 row holds multiples of {Q8_BLOCK} values, not {n}"
    return n // Q8_BLOCK * Q8_BYTES


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: to the nearest integer, ties away from zero (torch.round sends ties to even)."""
    t = v.trunc()
    return torch.where((v - t).abs() == 0.5, t + v.sign(), v.round())  # v - trunc(v) is exact


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] (any float dtype; N a multiple of 32) -> [..., N / 32 * 34] uint8 Q8_0 blocks."""
    n = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], q8_0_row_bytes(n) // Q8_BYTES, Q8_BLOCK)  # [..., nb, 32]
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., nb, 1]
    # a tensor divisor: torch on CUDA divides by a Python number as a multiply by its reciprocal,
    # an ulp off ggml's division in a few percent of blocks (and then a byte off now and then)
    d = amax / torch.full_like(amax, 127.0)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = round_half_away(blocks * inv).to(torch.int8)  # |x * inv| <= 127 (+ an ulp): no clamp needed
    out = torch.empty(*blocks.shape[:-1], Q8_BYTES, dtype=torch.uint8, device=x.device)  # [..., nb, 34]
    out[..., :2] = d.to(torch.float16).view(torch.uint8)
    out[..., 2:] = q.view(torch.uint8)
    return out.reshape(*x.shape[:-1], q8_0_row_bytes(n))
