"""Dequantization of GGML blocks into float32 torch tensors: the twin of the CUDA decoders.

Vectorised over blocks, so the same code runs on the CPU and on a GPU. Products and sums are fp32
in the order `gguf.quants` (and llama.cpp) use, so results are bit-exact with
`gguf.quants.dequantize` (tests/test_quant.py, block by block), with ggml's C for the IQ grid and
ternary types (tests/test_quant_iq.py) and with `cuda_src/ggml_blocks.cuh`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.quant import grids
from strata_mgpu.quant.formats import block_format

Q = GGMLQuantizationType

# Shape legend: N = blocks, B = bytes per block, W = weights per block.

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL, IQ4_XS
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1 doubled (the scale is halved)


@cache
def _codebook(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
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


@cache
def _e8m0_halves(device: torch.device) -> torch.Tensor:
    """[256] float32: scale byte e as half of 2^(e - 127) (the codebook is doubled), the bits of
    ggml_e8m0_to_fp32_half: subnormal below e = 2, 2^127 at e = 255 (no NaN). A table built on the
    host, so no device's shifts or flushing of subnormals enter it."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return torch.from_numpy(bits.view(np.float32)).to(device)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:  # [e:e8m0][qs:16]
    d = _e8m0_halves(b.device)[b[:, 0:1].long()]  # [N, 1]
    return d * _codebook(MXFP4_VALUES, b.device)[_nibbles(b[:, 1:17]).long()]


# The IQ grid types (quant/grids.py has the grids). Each weight is a grid value times a scale, times
# a sign where the grid is unsigned; the products in ggml's order (dequantize_row_iq2_xxs, ...:
# (scale * grid) * sign), the sign a multiplication by -1 or 1, so that a zero keeps its sign as in C.


@cache
def _grid_rows(name: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(grids.grid(name).astype(np.float32)).to(device)


@cache
def _bit_signs(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: entry [s, j] is -1 where bit j of the sign byte s is set, else 1."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return (1.0 - 2.0 * bits.float()).to(device)


@cache
def _ksign_rows(device: torch.device) -> torch.Tensor:
    """[128, 8] float32: the signs of the 7-bit sign index s (ksigns_iq2xs[s]'s bits)."""
    return _bit_signs(device)[torch.from_numpy(grids.ksigns().astype(np.int64)).to(device)]


def _le(b: torch.Tensor) -> torch.Tensor:
    """Little-endian words: [..., k] uint8 -> [...] int64 (k <= 4)."""
    shifts = torch.arange(0, 8 * b.shape[-1], 8, device=b.device)
    return (b.long() << shifts).sum(-1)


def _fields(words: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """`count` fields of `width` bits from the low end of each word: [...] int64 -> [..., count]."""
    shifts = torch.arange(0, width * count, width, device=words.device)
    return (words[..., None] >> shifts) & ((1 << width) - 1)


def _nibble_pairs(b: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 -> [..., 2k] int64: each byte's low nibble, then its high one."""
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*b.shape[:-1], -1).long()


def _iq2_db(d: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    """The IQ2 types' group scale, d * (0.5 + ls) * 0.25, in ggml's order."""
    return d * (0.5 + ls.float()) * 0.25


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:64]
    # Sub-block s is bytes 2 + 8 s ...: four grid indices (8 weights each), then a u32: 4 x 7 sign bits, scale in 28-31.
    n, dev = b.shape[0], b.device
    q = b[:, 2:66].reshape(n, 8, 8)
    aux = _le(q[:, :, 4:8])  # [N, 8]
    db = _iq2_db(_f16(b, 0), aux >> 28)  # [N, 8]
    grid = _grid_rows("iq2xxs_grid", dev)[q[:, :, 0:4].long()]  # [N, 8, 4, 8]
    signs = _ksign_rows(dev)[_fields(aux, 7, 4)]  # [N, 8, 4, 8]
    return (db[:, :, None, None] * grid * signs).reshape(n, 256)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:u16 x32][scales:8]
    # Group g (8 weights) is u16 g: grid index in bits 0-8, its sign index in 9-15; sub-block s's
    # scale byte: groups 4s, 4s + 1 take the low nibble, 4s + 2, 4s + 3 the high one.
    n, dev = b.shape[0], b.device
    q = _le(b[:, 2:66].reshape(n, 32, 2))  # [N, 32]
    ls = _nibble_pairs(b[:, 66:74]).repeat_interleave(2, dim=1)  # [N, 32]
    db = _iq2_db(_f16(b, 0), ls)
    grid = _grid_rows("iq2xs_grid", dev)[q & 511]  # [N, 32, 8]
    signs = _ksign_rows(dev)[q >> 9]
    return (db[:, :, None] * grid * signs).reshape(n, 256)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:32][signs:32][qh:8][scales:8]
    # Group g: grid index qs[g] | bits 2(g % 4).. of qh[g / 4] << 8, its signs byte signs[g] bit by bit.
    n, dev = b.shape[0], b.device
    high = _fields(b[:, 66:74].long(), 2, 4).reshape(n, 32)  # [N, 32]
    idx = b[:, 2:34].long() | (high << 8)
    ls = _nibble_pairs(b[:, 74:82]).repeat_interleave(2, dim=1)
    db = _iq2_db(_f16(b, 0), ls)
    grid = _grid_rows("iq2s_grid", dev)[idx]  # [N, 32, 8]
    signs = _bit_signs(dev)[b[:, 34:66].long()]
    return (db[:, :, None] * grid * signs).reshape(n, 256)


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:64][scales_signs:u32 x8]
    # Sub-block s: 8 grid indices qs[8 s ...] (4 weights each); u32 s: 4 x 7 sign bits (8 weights each), scale in 28-31.
    n, dev = b.shape[0], b.device
    aux = _le(b[:, 66:98].reshape(n, 8, 4))  # [N, 8]
    db = _f16(b, 0) * (0.5 + (aux >> 28).float()) * 0.5  # [N, 8]
    grid = _grid_rows("iq3xxs_grid", dev)[b[:, 2:66].reshape(n, 8, 8).long()].reshape(n, 8, 4, 8)
    signs = _ksign_rows(dev)[_fields(aux, 7, 4)]  # [N, 8, 4, 8]
    return (db[:, :, None, None] * grid * signs).reshape(n, 256)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:64][qh:8][signs:32][scales:4]
    # Sub-block s: grid indices qs[8 s + k] | bit k of qh[s] << 8 (4 weights each), signs[4 s ...]
    # bit by bit; its scale: nibble s of the scales (low nibble first), d * (1 + 2 scale).
    n, dev = b.shape[0], b.device
    idx = b[:, 2:66].reshape(n, 8, 8).long() | (_fields(b[:, 66:74].long(), 1, 8) << 8)
    grid = _grid_rows("iq3s_grid", dev)[idx].reshape(n, 8, 4, 8)
    signs = _bit_signs(dev)[b[:, 74:106].reshape(n, 8, 4).long()]  # [N, 8, 4, 8]
    db = _f16(b, 0) * (1 + 2 * _nibble_pairs(b[:, 106:110])).float()  # [N, 8]
    return (db[:, :, None, None] * grid * signs).reshape(n, 256)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:  # [d:f16][qs:32][qh:u16 x8]
    # Sub-block s, u16 qh[s]: bits 3l..3l+2 are group l's index bits 8-10 (qs[4 s + l] the low 8),
    # 12-14 the scale, 15 the delta's sign; a weight is (d * (2 scale + 1)) * (grid + delta).
    n, dev = b.shape[0], b.device
    qh = _le(b[:, 34:50].reshape(n, 8, 2))  # [N, 8]
    dl = _f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()  # [N, 8]
    delta = _codebook((grids.IQ1S_DELTA, -grids.IQ1S_DELTA), dev)[qh >> 15]  # [N, 8]
    idx = b[:, 2:34].reshape(n, 8, 4).long() | (_fields(qh, 3, 4) << 8)
    grid = _grid_rows("iq1s_grid", dev)[idx]  # [N, 8, 4, 8]
    return (dl[:, :, None, None] * (grid + delta[:, :, None, None])).reshape(n, 256)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:  # [qs:32][qh:16][scales:u16 x4]
    # Group g (8 weights): nibble g of qh (low nibble first) holds index bits 8-10 (qs[g] the low
    # 8) and in bit 3 the delta's sign; 3-bit field g / 2 of the scale words (four a word, from bit
    # 0) its scale; the words' top nibbles are the block's fp16 d.
    n, dev = b.shape[0], b.device
    sc = _le(b[:, 48:56].reshape(n, 4, 2))  # [N, 4]
    d_bits = (sc >> 12) << torch.arange(0, 16, 4, device=dev)  # [N, 4]: nibble k of d
    d_bits = d_bits.sum(1, keepdim=True)  # [N, 1]
    d = torch.cat([d_bits & 0xFF, d_bits >> 8], dim=1).to(torch.uint8).view(torch.float16).float()  # [N, 1]
    dl = d * (2 * _fields(sc, 3, 4).reshape(n, 16) + 1).float()  # [N, 16]: a scale for each 16 weights
    nib = _nibble_pairs(b[:, 32:48])  # [N, 32]
    idx = b[:, 0:32].long() | ((nib & 7) << 8)
    delta = _codebook((grids.IQ1S_DELTA, -grids.IQ1S_DELTA), dev)[nib >> 3]  # [N, 32]
    grid = _grid_rows("iq1s_grid", dev)[idx]  # [N, 32, 8]
    return (dl.repeat_interleave(2, dim=1)[:, :, None] * (grid + delta[:, :, None])).reshape(n, 256)


@cache
def _tq1_layout(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """TQ1_0's weights in order: the byte each reads and the power of 3 it multiplies it by. qs[0:32]
    hold weights 0-159 (5 runs of 32, the n-th run digit n), qs[32:48] weights 160-239 (5 runs of
    16), qh[0:4] weights 240-255 (4 runs of 4)."""
    pos: list[int] = []
    power: list[int] = []
    for start, run, digits in ((0, 32, 5), (32, 16, 5), (48, 4, 4)):
        for n in range(digits):
            pos += range(start, start + run)
            power += [3 ** n] * run
    return torch.tensor(pos, device=device), torch.tensor(power, device=device)


def _tq1_0(b: torch.Tensor) -> torch.Tensor:  # [qs:48][qh:4][d:f16]
    # A byte holds 5 (qh: 4) base-3 digits as a fixed-point fraction: digit n is the top "trit" of
    # (byte * 3^n) mod 256, i.e. ((byte * 3^n mod 256) * 3) >> 8; a weight is (digit - 1) * d.
    pos, power = _tq1_layout(b.device)
    q = (b[:, pos].long() * power) & 0xFF  # [N, 256]
    return (((q * 3) >> 8) - 1).float() * _f16(b, 52)


def _tq2_0(b: torch.Tensor) -> torch.Tensor:  # [qs:64][d:f16]
    # Weight 128 j + 32 l + m is bits 2l..2l+1 of qs[32 j + m], minus 1.
    n = b.shape[0]
    q = _fields(b[:, 0:64].reshape(n, 2, 1, 32).long(), 2, 4)  # [N, 2, 1, 32, 4]: l last
    q = q.reshape(n, 2, 32, 4).transpose(2, 3).reshape(n, 256)
    return (q - 1).float() * _f16(b, 64)


_TORCH_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.MXFP4: _mxfp4,
    Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ2_S: _iq2_s, Q.IQ3_XXS: _iq3_xxs, Q.IQ3_S: _iq3_s,
    Q.IQ1_S: _iq1_s, Q.IQ1_M: _iq1_m, Q.TQ1_0: _tq1_0, Q.TQ2_0: _tq2_0,
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
    """Host bytes of a tensor ([..., row_bytes] uint8) -> float32 tensor of `shape` on `device`."""
    fmt = block_format(ggml_type)
    row_len = shape[-1]
    flat = np.array(raw, dtype=np.uint8).reshape(-1, fmt.row_bytes(row_len))  # owned copy: memmaps are read-only
    return dequantize_rows(torch.from_numpy(flat).to(device), ggml_type, row_len).reshape(shape)
