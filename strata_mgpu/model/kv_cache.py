"""A sequence's KV as the decoder sees it (`SequenceKV`), and its plain form, `KVCache`: keys and
values of every layer, grown by doubling. `KVFormat`: how a cache stores its cells
(`--cache-type-k` / `--cache-type-v`), plain in the compute dtype or as ggml Q8_0 blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.config import KV_CACHE_TYPES
from strata_mgpu.quant.dequant import dequantize_rows
from strata_mgpu.quant.quantize import Q8_BLOCK, Q8_BYTES, q8_0_row_bytes, quantize_q8_0

Q = GGMLQuantizationType
# What keys or values may be stored as (`config.KV_CACHE_TYPES`): BF16 is the plain cell in the
# compute dtype (bf16 on a GPU stage; the fp32 reference keeps fp32).
PLAIN_KV = (Q.BF16, Q.BF16)  # (keys, values)
_PLAIN_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "f16"}


def kv_cell_bytes(keys: GGMLQuantizationType, values: GGMLQuantizationType, kv_dim: int, elem: int) -> int:
    """Bytes one position takes in one layer, keys and values (kv_dim = Hkv * Dh values each; `elem`:
    the compute dtype's bytes)."""
    return sum(q8_0_row_bytes(kv_dim) if t == Q.Q8_0 else kv_dim * elem for t in (keys, values))


@dataclass(frozen=True)
class KVFormat:
    """How a cache stores keys and values, each on its own (`keys`, `values`):
    - BF16: plain, [..., Hkv, Dh] in the compute `dtype`;
    - Q8_0: raw ggml blocks, uint8 [..., Hkv, Dh / 32 * 34]: a head's Dh values as Dh / 32 blocks
      of [d: fp16][q: int8 x 32] (x = d q, d = max|x| / 127; `quant.quantize`).
    Whatever moves cells moves them as they are stored; `store` quantizes new cells, `load`
    dequantizes (to `dtype`) for attention. A zeroed cell reads as zeros either way."""

    dtype: torch.dtype = torch.float32
    keys: GGMLQuantizationType = Q.BF16
    values: GGMLQuantizationType = Q.BF16

    def __post_init__(self) -> None:
        assert self.keys in KV_CACHE_TYPES and self.values in KV_CACHE_TYPES, (self.keys, self.values)

    @property
    def types(self) -> tuple[GGMLQuantizationType, GGMLQuantizationType]:
        return self.keys, self.values

    @property
    def quantized(self) -> bool:
        return Q.Q8_0 in self.types

    def storage(self, t: GGMLQuantizationType) -> torch.dtype:
        return torch.uint8 if t == Q.Q8_0 else self.dtype

    def row(self, t: GGMLQuantizationType, head_dim: int) -> int:
        return q8_0_row_bytes(head_dim) if t == Q.Q8_0 else head_dim

    def zeros(self, t: GGMLQuantizationType, *shape: int, device: torch.device | str) -> torch.Tensor:
        """Cells [..., Hkv, Dh] stored as `t`: shape's last dim is Dh, the tensor's `row(t, Dh)`."""
        return torch.zeros(*shape[:-1], self.row(t, shape[-1]), device=device, dtype=self.storage(t))

    def cell_bytes(self, kv_dim: int) -> int:
        return kv_cell_bytes(self.keys, self.values, kv_dim, self.dtype.itemsize)

    def store(self, t: GGMLQuantizationType, x: torch.Tensor) -> torch.Tensor:
        """New cells [..., Dh] as `t` stores them (plain: x itself)."""
        return quantize_q8_0(x) if t == Q.Q8_0 else x

    def load(self, t: GGMLQuantizationType, cells: torch.Tensor) -> torch.Tensor:
        """Stored cells [..., row(t, Dh)] -> [..., Dh] in `dtype` (plain: no copy)."""
        if t != Q.Q8_0:
            return cells
        row = cells.shape[-1]
        dh = row // Q8_BYTES * Q8_BLOCK
        return dequantize_rows(cells.reshape(-1, row), Q.Q8_0, dh).to(self.dtype).view(*cells.shape[:-1], dh)

    def describe(self) -> str:
        k, v = ("q8_0" if t == Q.Q8_0 else _PLAIN_NAMES.get(self.dtype, str(self.dtype)) for t in self.types)
        return k if k == v else f"k {k}, v {v}"


class SequenceKV(Protocol):
    """One sequence's keys and values for a decoder's layers.

    `length` counts the positions written by completed forwards. A forward reserves its rows,
    writes each layer's keys and values (`write`), then advances. `k`/`v` [L, capacity, Hkv, row]
    hold the VRAM cells as `format` stores them; where `graph_capturable` every cell sits at its own
    position, so the decode step's kernels may read and write them in place by address.
    `block_table`: where cells are a pool's (model/kv_pool.py), int32 [max blocks] on the device,
    position p in cell `block_table[p // block_tokens] * block_tokens + p % block_tokens` of `k`/`v`
    (then the pool's whole storage); None: cell p is position p.
    """

    k: torch.Tensor
    v: torch.Tensor
    length: int
    max_length: int
    format: KVFormat
    block_table: torch.Tensor | None
    block_tokens: int

    @property
    def capacity(self) -> int: ...

    @property
    def graph_capturable(self) -> bool:
        """Every cell, the next one's included, sits in `k`/`v` at its own position."""
        ...

    @property
    def offset_writes(self) -> bool:
        """`write` takes rows `at` an offset past the cached ones (a forward in two halves)."""
        ...

    @property
    def nbytes(self) -> int:
        ...

    def reserve(self, new_tokens: int) -> None:
        """Room for `new_tokens` more (ValueError past max_length)."""
        ...

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, at: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [T, Hkv, Dh] keys/values `at` rows past the cached ones; all keys/values up to them
        [length + at + T, Hkv, Dh], in the compute dtype."""
        ...

    def advance(self, n: int) -> None: ...

    def prefetch(self, layer: int) -> None:
        """Start bringing `layer`'s cells that live in host RAM to the device, a layer ahead of its
        attention."""
        ...

    def drain(self) -> None:
        """A forward failed: wait for the copies `prefetch` started, forget them."""
        ...


class KVCache:
    """Keys and values of one sequence for `n_layers` layers, [capacity, Hkv, row] per layer.

    Unwritten rows are zeros, never garbage: the static decode step attends over the whole capacity
    under a mask, and a masked NaN would still poison the softmax and P @ V.
    """

    block_table: torch.Tensor | None = None  # cell p is position p
    block_tokens = 0

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, capacity: int = 256,
                 max_length: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 keys: GGMLQuantizationType = Q.BF16, values: GGMLQuantizationType = Q.BF16):
        assert capacity > 0 and max_length > 0
        self.max_length = max_length
        self.length = 0
        self.format = KVFormat(dtype, keys, values)
        cap = min(capacity, max_length)
        self.k = self.format.zeros(keys, n_layers, cap, n_kv_heads, head_dim, device=device)
        self.v = self.format.zeros(values, n_layers, cap, n_kv_heads, head_dim, device=device)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def graph_capturable(self) -> bool:
        return True

    @property
    def offset_writes(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def reserve(self, new_tokens: int) -> None:
        need = self.length + new_tokens
        if need > self.max_length:
            raise ValueError(f"sequence of {need} tokens exceeds the context of {self.max_length}")
        if need <= self.capacity:
            return
        cap = min(self.max_length, max(need, 2 * self.capacity))
        k = self.k.new_zeros(self.k.shape[0], cap, *self.k.shape[2:])
        v = self.v.new_zeros(self.v.shape[0], cap, *self.v.shape[2:])
        k[:, :self.length] = self.k[:, :self.length]
        v[:, :self.length] = self.v[:, :self.length]
        self.k, self.v = k, v

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, at: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.length + at
        end = start + k_new.shape[0]
        assert end <= self.capacity, "reserve() before writing"
        f = self.format
        self.k[layer, start:end] = f.store(f.keys, k_new)
        self.v[layer, start:end] = f.store(f.values, v_new)
        return f.load(f.keys, self.k[layer, :end]), f.load(f.values, self.v[layer, :end])

    def advance(self, n: int) -> None:
        self.length += n

    def prefetch(self, layer: int) -> None:
        """Every cell is in VRAM: nothing to bring."""

    def drain(self) -> None:
        """Nothing in flight."""
