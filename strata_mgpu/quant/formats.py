"""The one table of block formats strata serves: sizes (from `gguf.constants`), the scale-field
layout the synthetic writer uses, and which implementations each format has.

`scale_fields` lists the byte offsets of each block's fp16 scale words: dequantized values are
linear in them, which is how the synthetic writer sets the weights' magnitude. IQ1_M has no such
word: its one fp16 scale is spread over four nibbles (`nibble_f16_fields`).

Capabilities (every other list of types derives from these flags):
  torch_dequant  quant/dequant.py, the twin. A format without it is not served: `block_format`
                 refuses it, so a model fails at load, in one line.
  cuda_dequant   cuda_src/dequant.cu, bit-exact with the twin.
  fused_decode   cuda_src/moe_decode.cu, decode's experts straight from their blocks; without it
                 decode gathers through the dequant and runs the grouped GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType


@dataclass(frozen=True)
class BlockFormat:
    ggml_type: GGMLQuantizationType
    scale_fields: tuple[int, ...]  # byte offsets of fp16 scales inside a block (empty: float types)
    e8m0_fields: tuple[int, ...] = ()  # byte offsets of power-of-two exponent scales (MXFP4)
    # IQ1_M: byte offsets of the four u16 words whose top nibbles make its one fp16 scale, lowest first
    nibble_f16_fields: tuple[int, ...] = ()
    torch_dequant: bool = True
    cuda_dequant: bool = True
    fused_decode: bool = True

    @property
    def name(self) -> str:
        return self.ggml_type.name

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.ggml_type][1]

    @property
    def is_float(self) -> bool:
        return self.ggml_type in (Q.F32, Q.F16, Q.BF16)

    def row_bytes(self, n: int) -> int:
        assert n % self.block_size == 0, f"{self.name}: row of {n} is not whole blocks of {self.block_size}"
        return n // self.block_size * self.type_size

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size

    @property
    def f16_scales(self) -> int:
        return len(self.scale_fields) + (1 if self.nibble_f16_fields else 0)


# Layouts (bytes inside one block), after ggml-common.h:
#   Q4_0   [d:f16][qs:16]                        32 weights, 4-bit, offset 8
#   Q4_1   [d:f16][m:f16][qs:16]
#   Q5_0   [d:f16][qh:4][qs:16]
#   Q5_1   [d:f16][m:f16][qh:4][qs:16]
#   Q8_0   [d:f16][qs:int8 x32]
#   Q2_K   [scales:16][qs:64][d:f16][dmin:f16]      256 weights in 16 sub-blocks
#   Q3_K   [hmask:32][qs:64][scales:12][d:f16]
#   Q4_K   [d:f16][dmin:f16][scales:12][qs:128]     8 sub-blocks of 32, 6-bit scales and mins
#   Q5_K   [d:f16][dmin:f16][scales:12][qh:32][qs:128]
#   Q6_K   [ql:128][qh:64][scales:int8 x16][d:f16]
#   IQ4_NL [d:f16][qs:16]                        non-linear 4-bit codebook
#   IQ4_XS [d:f16][scales_h:u16][scales_l:4][qs:128]
#   MXFP4  [e:e8m0][qs:16]                       FP4 (E2M1) values times 2^(e-127)
# The IQ grid types and the ternary ones (256 weights, 8 sub-blocks of 32; quant/grids.py has the
# grids; dequant.py draws each layout bit by bit):
#   IQ2_XXS [d:f16][qs:64]                       a sub-block: 4 grid bytes, then signs and its scale
#   IQ2_XS  [d:f16][qs:u16 x32][scales:8]        9-bit grid index + 7 sign bits a u16
#   IQ2_S   [d:f16][qs:32][signs:32][qh:8][scales:8]
#   IQ3_XXS [d:f16][qs:64][scales_signs:32]
#   IQ3_S   [d:f16][qs:64][qh:8][signs:32][scales:4]
#   IQ1_S   [d:f16][qs:32][qh:u16 x8]
#   IQ1_M   [qs:32][qh:16][scales:u16 x4]        the fp16 d in the top nibbles of the scales
#   TQ1_0   [qs:48][qh:4][d:f16]                 ternary, 5 (4) digits a byte in base 3
#   TQ2_0   [qs:64][d:f16]                       ternary, 2 bits a weight
# Every format here has all three implementations; a format added without one says so with its
# flag (and the CUDA type list in ggml_blocks.cuh, checked against this table by the tests).
_FORMATS = [
    BlockFormat(Q.F32, ()),
    BlockFormat(Q.F16, ()),
    BlockFormat(Q.BF16, ()),
    BlockFormat(Q.Q4_0, (0,)),
    BlockFormat(Q.Q4_1, (0, 2)),
    BlockFormat(Q.Q5_0, (0,)),
    BlockFormat(Q.Q5_1, (0, 2)),
    BlockFormat(Q.Q8_0, (0,)),
    BlockFormat(Q.Q2_K, (80, 82)),
    BlockFormat(Q.Q3_K, (108,)),
    BlockFormat(Q.Q4_K, (0, 2)),
    BlockFormat(Q.Q5_K, (0, 2)),
    BlockFormat(Q.Q6_K, (208,)),
    BlockFormat(Q.IQ4_NL, (0,)),
    BlockFormat(Q.IQ4_XS, (0,)),
    BlockFormat(Q.MXFP4, (), e8m0_fields=(0,)),
    BlockFormat(Q.IQ2_XXS, (0,)),
    BlockFormat(Q.IQ2_XS, (0,)),
    BlockFormat(Q.IQ2_S, (0,)),
    BlockFormat(Q.IQ3_XXS, (0,)),
    BlockFormat(Q.IQ3_S, (0,)),
    BlockFormat(Q.IQ1_S, (0,)),
    BlockFormat(Q.IQ1_M, (), nibble_f16_fields=(48, 50, 52, 54)),
    BlockFormat(Q.TQ1_0, (52,)),
    BlockFormat(Q.TQ2_0, (64,)),
]
FORMATS: dict[GGMLQuantizationType, BlockFormat] = {f.ggml_type: f for f in _FORMATS}
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(t for t, f in FORMATS.items() if f.torch_dequant)
CUDA_DEQUANT_TYPES: tuple[GGMLQuantizationType, ...] = tuple(t for t, f in FORMATS.items() if f.cuda_dequant)
FUSED_DECODE_TYPES: tuple[GGMLQuantizationType, ...] = tuple(t for t, f in FORMATS.items() if f.fused_decode)


def block_format(ggml_type: GGMLQuantizationType) -> BlockFormat:
    """The format of a type strata serves; a one-line ValueError for any other (model load calls this
    for every tensor, so an unservable file fails there)."""
    fmt = FORMATS.get(ggml_type)
    if fmt is None or not fmt.torch_dequant:
        served = ", ".join(t.name for t, f in FORMATS.items() if f.torch_dequant)
        raise ValueError(f"tensor type {GGMLQuantizationType(ggml_type).name} is not supported (supported: {served})")
    return fmt


def f16_scale_bits(fmt: BlockFormat, blocks: np.ndarray) -> np.ndarray:
    """[N, type_size] uint8 -> [N, fmt.f16_scales] uint16: the bits of each block's fp16 scales."""
    words = [_u16(blocks, at) for at in fmt.scale_fields]
    if fmt.nibble_f16_fields:  # nibble k of the scale is the top nibble of word k
        split = np.zeros(len(blocks), dtype=np.uint16)
        for k, at in enumerate(fmt.nibble_f16_fields):
            split |= (_u16(blocks, at) >> 12) << (4 * k)
        words.append(split)
    return np.stack(words, axis=1).astype(np.uint16) if words else np.zeros((len(blocks), 0), np.uint16)


def set_f16_scale_bits(fmt: BlockFormat, blocks: np.ndarray, bits: np.ndarray) -> None:
    """Write [N, fmt.f16_scales] uint16 scale bits into `blocks` [N, type_size] uint8 in place."""
    assert bits.shape == (len(blocks), fmt.f16_scales), (bits.shape, fmt.name)
    bits = bits.astype(np.uint16)
    for i, at in enumerate(fmt.scale_fields):
        blocks[:, at:at + 2] = bits[:, i:i + 1].astype("<u2").view(np.uint8)
    for k, at in enumerate(fmt.nibble_f16_fields):
        word = (_u16(blocks, at) & 0x0FFF) | (((bits[:, -1] >> (4 * k)) & 0xF) << 12)
        blocks[:, at:at + 2] = word.astype("<u2").reshape(-1, 1).view(np.uint8)


def _u16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at].astype(np.uint16) | (blocks[:, at + 1].astype(np.uint16) << 8)


def parse_type(name: str) -> GGMLQuantizationType:
    """'q4_k' -> Q4_K; a clear error for unknown or unsupported names."""
    try:
        t = GGMLQuantizationType[name.upper()]
    except KeyError:
        raise ValueError(f"unknown tensor type {name!r} (supported: "
                         f"{', '.join(t.name for t in SUPPORTED_TYPES)})") from None
    block_format(t)
    return t
