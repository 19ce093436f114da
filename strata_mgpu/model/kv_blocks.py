"""Fixed-size blocks of a sequence's KV, copied out of and into its cache: what the prefix cache
keeps (`engine.prefix_cache`).

A block holds `block_tokens` consecutive positions of every layer as the cache stores them, in
bytes: uint8 [L, B, K + V] (L = layers, B = block tokens, K and V = the bytes of a position's keys
and values in one layer), so a block is restored byte for byte whatever the format. Host blocks
are pinned where the device is a GPU. Every copy is queued on the caller's current stream, after
the forwards that wrote the rows it reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from strata_mgpu.model.kv_cache import KVFormat, SequenceKV


def cell_bytes(cells: torch.Tensor) -> torch.Tensor:
    """Cells [L, n, Hkv, row] (a view of a cache, its last dims contiguous) as bytes [L, n, Hkv * row *
    elem]: a view, so writing it writes the cache."""
    out = cells.flatten(2).view(torch.uint8)
    assert out.data_ptr() == cells.data_ptr(), "the cells' last dims are not contiguous"
    return out


class KVBlockStore:
    """Blocks of caches with `n_layers` layers of Hkv heads of Dh keys and values, stored as `format`
    says, on `device`."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, block_tokens: int,
                 device: torch.device, format: KVFormat):
        assert block_tokens > 0
        self.format, self.block_tokens, self.device = format, block_tokens, device
        self.key_bytes = n_kv_heads * format.row(format.keys, head_dim) * format.storage(format.keys).itemsize
        self.shape = (n_layers, block_tokens, format.cell_bytes(n_kv_heads * head_dim))  # [L, B, K + V]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.shape)

    @property
    def host_tier(self) -> bool:
        return self.device.type != "cpu"

    def cacheable(self, kv: SequenceKV) -> bool:
        return kv.rows_in_place

    def save(self, kv: SequenceKV, index: int) -> torch.Tensor:
        assert kv.rows_in_place, "a cache whose rows move cannot be saved from"
        rows = slice(index * self.block_tokens, (index + 1) * self.block_tokens)
        assert rows.stop <= kv.capacity, f"block {index} is past the cache's {kv.capacity} cells"
        assert kv.format == self.format, f"a {kv.format} cache saved into {self.format} blocks"
        return torch.cat((cell_bytes(kv.k[:, rows]), cell_bytes(kv.v[:, rows])), dim=2)  # [L, B, K + V], a copy

    def offload(self, block: torch.Tensor) -> torch.Tensor:
        """The block in host RAM (queued, not waited for: a later `load` on the same stream reads it after)."""
        host = torch.empty(block.shape, dtype=block.dtype, pin_memory=self.host_tier)
        host.copy_(block, non_blocking=self.host_tier)
        return host

    def load(self, kv: SequenceKV, blocks: Sequence[torch.Tensor], n_tokens: int) -> None:
        """Copy `blocks` into an empty `kv` at positions 0.. and advance it by `n_tokens` (at most the
        blocks' tokens: a continuation may keep only part of the last)."""
        assert kv.rows_in_place and kv.length == 0, "blocks load into a fresh cache whose rows stay in place"
        assert kv.format == self.format, f"{self.format} blocks loaded into a {kv.format} cache"
        b = self.block_tokens
        assert 0 < n_tokens <= b * len(blocks), f"{n_tokens} tokens from {len(blocks)} blocks of {b}"
        kv.reserve(n_tokens)
        for j, block in enumerate(blocks):
            n = min(b, n_tokens - j * b)
            if n <= 0:
                break
            src = block[:, :n].to(self.device, non_blocking=True)  # [L, n, K + V]
            cell_bytes(kv.k[:, j * b:j * b + n]).copy_(src[:, :, :self.key_bytes])
            cell_bytes(kv.v[:, j * b:j * b + n]).copy_(src[:, :, self.key_bytes:])
        kv.advance(n_tokens)
