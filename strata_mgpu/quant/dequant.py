"""Dequantization of GGML blocks into float32 torch tensors: the twin of the CUDA decoders.

Every format of `quant.formats` is written here in torch, vectorised over blocks (no Python loop
over blocks), so the same code runs on the CPU and on a GPU. The products and sums are fp32 in
the order `gguf.quants` (and llama.cpp) use, so results are bit-exact with `gguf.quants.dequantize`
(tests/test_quant.py compares every format block by block) and with `cuda_src/ggml_blocks.cuh`
(tests/test_gpu_quant.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.quant.formats import block_format

Q = GGMLQuantizationType

# Shape legend: N = blocks, B = bytes per block, W = weights per block.

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL, IQ4_XS
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1 doubled (the scale is halved)


@cache
def _codebook(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A codebook on `device`, made once (a host-to-device copy, not one a call)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """fp16 word at byte `at` of each block, as float32: [N, B] uint8 -> [N, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _u32(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Little-endian 32-bit word at byte `at` of each block: [N, B] uint8 -> [N, 1] int64."""
    b = blocks[:, at:at + 4].long()
    return b[:, 0:1] | (b[:, 1:2] << 8) | (b[:, 2:3] << 16) | (b[:, 3:4] << 24)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] uint8 -> [..., 32]: the 16 low nibbles, then the 16 high (the 32-weight layout)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _low_bits(word: torch.Tensor, n: int) -> torch.Tensor:
    """Bits 0..n-1 of [N, 1] int64 words: [N, n] int64."""
    return (word >> torch.arange(n, device=word.device)) & 1


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:16]
    q = _nibbles(b[:, 2:18]).float() - 8.0  # [N, 32]
    return _f16(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # [d:f16][m:f16][qs:16]
    q = _nibbles(b[:, 4:20]).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qh:u32][qs:16]; bit l of qh is weight l's 5th bit
    q = (_nibbles(b[:, 6:22]).long() | (_low_bits(_u32(b, 2), 32) << 4)).float() - 16.0
    return _f16(b, 0) * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # [d:f16][m:f16][qh:u32][qs:16]
    q = (_nibbles(b[:, 8:24]).long() | (_low_bits(_u32(b, 4), 32) << 4)).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:int8 x32]
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K 2-bit fields: [N, 64] -> [N, 16, 16]. Weight 128 h + 32 s + l is bits 2s..2s+1 of
    byte 32 h + l; 16 weights share a sub-block scale."""
    n = qs.shape[0]
    shifts = torch.arange(0, 8, 2, device=qs.device, dtype=torch.uint8)
    return ((qs.reshape(n, 2, 1, 32) >> shifts.reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)


def _q2_k(b: torch.Tensor) -> torch.Tensor:  # [scales:16][qs:64][d:f16][dmin:f16]
    n = b.shape[0]
    sc = b[:, 0:16]  # low nibble: scale, high nibble: min, of each 16 weights
    dl = (_f16(b, 80) * (sc & 0xF).float())[:, :, None]  # [N, 16, 1]
    ml = (_f16(b, 82) * (sc >> 4).float())[:, :, None]
    return (dl * _crumbs(b[:, 16:80]).float() - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:  # [hmask:32][qs:64][scales:12][d:f16]
    n = b.shape[0]
    s = b[:, 96:108].long()
    low = torch.cat([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], dim=1)  # [N, 16]: low 4 bits of scale i
    shifts = torch.arange(0, 8, 2, device=b.device)
    high = ((s[:, None, 8:12] >> shifts[None, :, None]) & 3).reshape(n, 16)  # bits 2(i//4) of byte 8 + i%4
    dl = (_f16(b, 108) * ((low | (high << 4)) - 32).float())[:, :, None]  # [N, 16, 1]
    hbit = ((b[:, None, 0:32] >> torch.arange(8, device=b.device, dtype=torch.uint8)[None, :, None]) & 1)
    hbit = hbit.reshape(n, 16, 16)  # weight 32 k + l: bit k of hmask[l]
    q = _crumbs(b[:, 32:96]).long() - ((hbit.long() ^ 1) << 2)  # the hmask bit set means no -4 offset
    return (dl * q.float()).reshape(n, 256)


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


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # [d:f16][dmin:f16][scales:12][qs:128]
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])  # [N, 8]
    qs = b[:, 16:144].reshape(n, 4, 32)  # 4 groups of 64 weights: low nibbles then high nibbles
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(n, 8, 32).float()  # [N, 8 sub-blocks, 32]
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # [d:f16][dmin:f16][scales:12][qh:32][qs:128]
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]  # [N, 32]: bit k of byte l is the 5th bit of weight l of sub-block k
    qs = b[:, 48:176].reshape(n, 4, 32)
    low = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(n, 8, 32)
    bits = torch.arange(8, device=b.device, dtype=torch.uint8)
    high = (qh[:, None, :] >> bits[None, :, None]) & 1  # [N, 8, 32]
    q = (low | (high << 4)).float()
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # [ql:128][qh:64][scales:int8 x16][d:f16]
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)  # two halves of 128 weights
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(b, 208)  # [N, 1]
    # Within a half: weights 0..31 = ql[0:32] low | qh bits 0-1; 32..63 = ql[32:64] low | bits 2-3;
    # 64..95 = ql[0:32] high | bits 4-5; 96..127 = ql[32:64] high | bits 6-7.
    lo = torch.cat([ql[:, :, 0:32] & 0xF, ql[:, :, 32:64] & 0xF, ql[:, :, 0:32] >> 4, ql[:, :, 32:64] >> 4],
                   dim=2)  # [N, 2, 128]
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).repeat_interleave(32)
    hi = (qh.repeat(1, 1, 4) >> shifts) & 3  # [N, 2, 128]
    q = (lo | (hi << 4)).float() - 32.0
    scale = sc.repeat_interleave(16, dim=2)  # 16 weights share a scale: [N, 2, 128]
    return (d[:, :, None] * scale * q).reshape(n, 256)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:16], codes index IQ4_VALUES
    return _f16(b, 0) * _codebook(IQ4_VALUES, b.device)[_nibbles(b[:, 2:18]).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:  # [d:f16][scales_h:u16][scales_l:4][qs:128]
    n = b.shape[0]
    high = (b[:, 2:3].long() | (b[:, 3:4].long() << 8)) >> torch.arange(0, 16, 2, device=b.device) & 3  # [N, 8]
    low = torch.stack([b[:, 4:8] & 0xF, b[:, 4:8] >> 4], dim=2).reshape(n, 8).long()  # sub-block 2i, 2i + 1
    dl = (_f16(b, 0) * ((low | (high << 4)) - 32).float())[:, :, None]  # [N, 8, 1]
    codes = _nibbles(b[:, 8:136].reshape(n, 8, 16)).long()  # [N, 8, 32]
    return (dl * _codebook(IQ4_VALUES, b.device)[codes]).reshape(n, 256)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:  # [e:e8m0][qs:16]
    e = b[:, 0:1].long()
    # Half of 2^(e - 127) (the codebook is doubled), as ggml_e8m0_to_fp32_half: subnormal below e = 2.
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(torch.int32)
    d = bits.view(torch.float32)  # [N, 1]
    return d * _codebook(MXFP4_VALUES, b.device)[_nibbles(b[:, 1:17]).long()]


_TORCH_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.MXFP4: _mxfp4,
}
_FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def dequantize_rows(raw: torch.Tensor, ggml_type: GGMLQuantizationType, row_len: int) -> torch.Tensor:
    """[R, row_bytes] uint8 on any device -> [R, row_len] float32 on that device."""
    fmt = block_format(ggml_type)
    rows = raw.shape[0]
    assert raw.dtype == torch.uint8 and raw.shape[1] == fmt.row_bytes(row_len), (raw.shape, fmt.name, row_len)
    if ggml_type in _FLOATS:
        return raw.contiguous().view(_FLOATS[ggml_type]).float().reshape(rows, row_len)
    blocks = raw.reshape(-1, fmt.type_size)
    return _TORCH_KERNELS[ggml_type](blocks).reshape(rows, row_len)


def dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...],
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Host bytes of a tensor ([..., row_bytes] uint8) -> float32 tensor of `shape`, dequantized on
    `device`."""
    fmt = block_format(ggml_type)
    row_len = shape[-1]
    flat = np.array(raw, dtype=np.uint8).reshape(-1, fmt.row_bytes(row_len))  # owned copy: memmaps are read-only
    return dequantize_rows(torch.from_numpy(flat).to(device), ggml_type, row_len).reshape(shape)
