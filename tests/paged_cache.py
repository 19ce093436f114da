"""A test-only paged KV cache: what the decode ops read of one (`SequenceKV`'s `k`, `v`, `format`,
`capacity`, `block_table`, `block_tokens`) over a pool's storage shared by its sequences, and the
contiguous `KVCache` holding the same cells, which the ops' results on it must equal. The engine's
own pool (model/kv_pool.py) replaces it where these tests take a real one."""

from __future__ import annotations

import copy

import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.kv_cache import KVCache, KVFormat
from strata_mgpu.model.ops import kv_cells

Q = GGMLQuantizationType


class Pool:
    """Storage of `n_blocks` blocks of `block_tokens` cells, every layer: k, v [L, n_blocks * B, Hkv, row],
    each cell a random valid one of its format (other sequences' junk, never zeros)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int, block_tokens: int,
                 fmt: KVFormat, device: torch.device | str, generator: torch.Generator):
        self.format, self.block_tokens, self.n_blocks, self.head_dim = fmt, block_tokens, n_blocks, head_dim
        cells = n_blocks * block_tokens
        self.k, self.v = ((fmt.store(t, torch.randn(n_layers, cells, n_kv_heads, head_dim, device=device,
                                                    generator=generator).to(fmt.dtype)).contiguous())
                          for t in fmt.types)

    def sequence(self, blocks: list[int], max_blocks: int) -> PagedKV:
        return PagedKV(self, blocks, max_blocks)

    def copy(self) -> Pool:
        """A pool of the same cells in storage of its own."""
        twin = copy.copy(self)
        twin.k, twin.v = self.k.clone(), self.v.clone()
        return twin


class PagedKV:
    """One sequence of a `Pool`: its positions in `blocks` (in order), a table of `max_blocks` entries
    (the unused ones 0)."""

    def __init__(self, pool: Pool, blocks: list[int], max_blocks: int):
        assert len(blocks) <= max_blocks and all(0 <= b < pool.n_blocks for b in blocks)
        self.pool, self.k, self.v, self.format = pool, pool.k, pool.v, pool.format
        self.block_tokens = pool.block_tokens
        self.blocks = list(blocks)
        self.block_table = torch.zeros(max_blocks, dtype=torch.int32, device=pool.k.device)
        self.block_table[:len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.length = 0

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_tokens

    def grow(self, block: int) -> None:
        """One more block, written into the table in place (on the device, on the current stream): the
        table's address stays."""
        self.block_table[len(self.blocks)] = block
        self.blocks.append(block)

    def on(self, pool: Pool) -> PagedKV:
        """The same blocks in another pool (a table of its own)."""
        return PagedKV(pool, self.blocks, self.block_table.numel())

    def cells(self) -> torch.Tensor:
        """The pool's cells of positions 0..capacity-1 [capacity] int64."""
        return kv_cells(self, torch.arange(self.capacity, device=self.k.device))

    def contiguous(self) -> KVCache:
        """A contiguous cache holding this sequence's cells at their positions (a copy)."""
        n_layers, _, hkv, _ = self.k.shape
        f = self.format
        kv = KVCache(n_layers, hkv, self.pool.head_dim, capacity=self.capacity, max_length=self.capacity,
                     device=self.k.device, dtype=f.dtype, keys=f.keys, values=f.values)
        kv.k.copy_(self.k[:, self.cells()])
        kv.v.copy_(self.v[:, self.cells()])
        return kv


def random_blocks(n_blocks: int, counts: list[int], generator: torch.Generator) -> list[list[int]]:
    """Disjoint lists of `counts` blocks each, drawn from a random permutation of the pool's."""
    order = torch.randperm(n_blocks, generator=generator, device=generator.device).tolist()
    assert sum(counts) <= n_blocks
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [order[s:s + c] for s, c in zip(starts, counts, strict=True)]
