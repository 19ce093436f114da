"""The KV of a stage's sequences within its VRAM plan: `StageKV`.

The plan keeps `kv_tokens` cells in VRAM for all sequences together: the stage's part of the KV
pool (`stage/kv/pool.py`), blocks of it a sequence's `PagedKV`. A sequence longer than the pool
holds every block and uses the pool's cells as the VRAM ring of a `two_tier.TwoTierKV`, its older
cells in pinned host RAM, assembled in a staging buffer the stage shares, made at the first long
sequence.
"""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.kv_cache import PLAIN_KV, KVFormat
from strata_mgpu.model.kv_pool import (
    DEFAULT_BLOCK_TOKENS,
    BlockPool,
    BlockTable,
    KVStorage,
    PagedKV,
    PoolStorages,
    free_with,
)
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.kv.pool import StagePool
from strata_mgpu.stage.kv.two_tier import KVStaging, TwoTierKV
from strata_mgpu.stage.memory_plan import kv_layers


class StageKV:
    """Makes each sequence's KV for a stage's `layers` (their full-attention ones: a hybrid model's
    DeltaNet layers keep no KV, their state lives beside it): `vram_cells` for all sequences together,
    sequences of up to `context` tokens; `prefetch`: spilled cells uploaded a layer ahead on a side
    stream; `kv_types`: how the cells are stored."""

    def __init__(self, ctx: DeviceContext, spec: ModelSpec, layers: range, *, vram_cells: int, context: int,
                 dtype: torch.dtype, prefetch: bool,
                 kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV):
        self.ctx, self.spec, self.layers, self.dtype, self.prefetch = ctx, spec, layers, dtype, prefetch
        self.n_layers = kv_layers(spec, layers)  # the layers a sequence's KV holds
        self.format = KVFormat(dtype, *kv_types)
        self.vram_cells = vram_cells
        self.max_context = max(context, vram_cells)  # the longest sequence planned for
        self._staging: KVStaging | None = None

        self.pool: StagePool | None = None  # the latest: where a sequence without a table takes its blocks
        self._storages = PoolStorages()

    def blocks_for(self, block_tokens: int) -> int:
        """Blocks of `block_tokens` the plan's KV cells hold."""
        return max(1, self.vram_cells // block_tokens)

    def make_pool(self, block_tokens: int, blocks: BlockPool | None = None) -> StagePool:
        """A fresh pool of blocks of `block_tokens` (one engine drives a stage: an earlier pool's blocks are
        forgotten, its cells reused where the block size is the same). `blocks`: the bookkeeping a split's
        stages share (each stage holds every block's cells of its own layers), at most `blocks_for` blocks."""
        n = self.blocks_for(block_tokens) if blocks is None else blocks.n_blocks
        assert n <= self.blocks_for(block_tokens), f"{n} blocks of {block_tokens} exceed the stage's plan"
        blocks = BlockPool(n, block_tokens) if blocks is None else blocks
        self.pool = None  # (a pool no one holds any more gives its cells to the new one)
        storage = self._storages.add(blocks, lambda: self._storage(n, block_tokens),
                                     lambda st: (st.n_blocks, st.block_tokens) == (n, block_tokens))
        self.pool = StagePool(self.ctx, blocks, storage)
        return self.pool

    def _storage(self, n_blocks: int, block_tokens: int) -> KVStorage:
        with self.ctx.on_compute():
            storage = KVStorage(self.n_layers, self.spec.n_kv_heads, self.spec.head_dim, n_blocks=n_blocks,
                                block_tokens=block_tokens, device=self.ctx.device, format=self.format)
        self.ctx.label(storage.k, "kv pool keys")
        self.ctx.label(storage.v, "kv pool values")
        return storage

    def new_sequence(self, max_length: int, table: BlockTable | None = None, length: int = 0
                     ) -> PagedKV | TwoTierKV:
        """In the pool's blocks when it fits the pool, else a two-tier cache on the whole pool (its table
        holds every block). Without a table (tools, tests): a table of its own, freed with it."""
        if max_length > self.max_context:
            raise ValueError(f"a sequence of {max_length} tokens exceeds the {self.max_context} this stage planned "
                             f"its KV for")
        pool = self.pool or self.make_pool(min(DEFAULT_BLOCK_TOKENS, self.vram_cells))
        blocks = pool.blocks if table is None else table.pool
        storage = self._storages.of(blocks)
        pool_tokens = blocks.n_blocks * blocks.block_tokens
        own = table is None
        if table is None:
            table = BlockTable(blocks, min(max_length, pool_tokens))
        kv: PagedKV | TwoTierKV
        with self.ctx.on_compute():
            if max_length <= pool_tokens:
                kv = PagedKV(storage, table, length=length, max_length=max_length)
            else:
                assert length == 0, "a two-tier sequence starts empty"
                if self._staging is None:  # one buffer for the planned context, as the plan counted it
                    self._staging = KVStaging.for_model(self.spec, self.max_context, ctx=self.ctx, dtype=self.dtype,
                                                        kv_types=self.format.types, prefetch=self.prefetch)
                if own and table.missing(pool_tokens) > blocks.free_blocks:
                    # (tools, tests: beside other sequences, outside any engine) a ring of its own, as wide
                    ring = None
                else:
                    table.ensure(pool_tokens)
                    ring = (storage.k, storage.v)  # the whole pool's cells
                kv = TwoTierKV(self.n_layers, self.spec.n_kv_heads, self.spec.head_dim, window=pool_tokens,
                               max_length=max_length, staging=self._staging, dtype=self.dtype,
                               kv_types=self.format.types, ring=ring, capacity=pool_tokens)
        if own:
            free_with(kv, table)
        return kv
