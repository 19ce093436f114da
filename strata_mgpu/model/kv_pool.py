"""The paged KV: one pool of fixed-size blocks, shared by every sequence and the prefix cache.

`BlockPool` is the bookkeeping, device-blind: `n_blocks` blocks of `block_tokens` positions, a
free list and a reference count per block. A sequence holds a `BlockTable` (its blocks in
position order: position p sits in block `ids[p // B]` at offset `p % B`); the prefix cache holds
references to the blocks it indexes, so a block shared by a cached prefix and the sequences that
continue it is stored once. A block returns to the free list when its last reference goes.
Where the free list runs dry the pool asks its `reclaim` hook (the prefix cache: blocks only it
holds) before `PoolExhausted`, which the scheduler answers by preempting a sequence.

`KVStorage` is a pool's cells on one device for some layers, keys and values [L, n_blocks * B,
Hkv, R] as a `KVFormat` stores them (layer-major: one layer's cells are one tensor, block b's
cells are rows [b B, (b + 1) B) of it). `PagedKV` is one sequence's `SequenceKV` over a storage
and a table: `k`/`v` are the whole storage, `block_table` the table's ids on the device, which
the decode kernels read to find a position's cell.

Shape legend: L = layers of the storage, N = blocks, B = block tokens, Hkv = KV heads, R = a
head's stored row (Dh, or Dh / 32 * 34 bytes of Q8_0 blocks).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable

import torch

from strata_mgpu.model.kv_cache import KVFormat

# the block a pool is made of where its maker says nothing (the engine passes --prefix-block-tokens' own)
DEFAULT_BLOCK_TOKENS = 64


class PoolExhausted(RuntimeError):
    """No free block, and nothing the prefix cache could give back."""


class BlockPool:
    """Free list and reference counts of `n_blocks` blocks of `block_tokens` positions. Its changes, and
    a table's growth, hold `lock`: a split's stages reserve a sequence's shared table on their own
    threads (re-entrant: `reclaim` gives blocks back from inside an allocation)."""

    def __init__(self, n_blocks: int, block_tokens: int):
        assert n_blocks >= 1 and block_tokens >= 1
        self.n_blocks, self.block_tokens = n_blocks, block_tokens
        self.lock = threading.RLock()
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: the lowest id goes first
        # called with the blocks still missing; gives back up to that many (the prefix cache's)
        self.reclaim: Callable[[int], int] | None = None

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def available(self, reclaimable: int = 0) -> int:
        """Blocks an allocation could have: the free ones and `reclaimable` of the cache's."""
        return len(self._free) + reclaimable

    def allocate(self, n: int) -> list[int]:
        """n blocks, each with one reference: all of them or, raising PoolExhausted, none."""
        with self.lock:
            if n > len(self._free) and self.reclaim is not None:
                self.reclaim(n - len(self._free))
            if n > len(self._free):
                raise PoolExhausted(f"the KV pool has {len(self._free)} free blocks of {self.block_tokens} tokens, "
                                    f"{n} asked for")
            ids = [self._free.pop() for _ in range(n)]
            for b in ids:
                assert self.refs[b] == 0, f"block {b} on the free list is referenced"
                self.refs[b] = 1
            return ids

    def ref(self, ids: Iterable[int]) -> None:
        with self.lock:
            for b in ids:
                assert self.refs[b] > 0, f"block {b} is free: it cannot gain a reference"
                self.refs[b] += 1

    def unref(self, ids: Iterable[int]) -> None:
        with self.lock:
            for b in ids:
                assert self.refs[b] > 0, f"block {b} is free already"
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self._free.append(b)


class BlockTable:
    """One sequence's blocks in position order; each id holds one reference of the pool's. `max_blocks`:
    the most it may come to hold (its device copies are laid out for that many)."""

    def __init__(self, pool: BlockPool, max_tokens: int, prefix: Iterable[int] = ()):
        self.pool = pool
        self.max_blocks = max(1, pool.blocks_for(max_tokens))
        self.ids: list[int] = list(prefix)  # references taken by the caller (`adopt`) or by `ensure`
        assert len(self.ids) <= self.max_blocks
        self.freed = False

    @classmethod
    def adopt(cls, pool: BlockPool, max_tokens: int, prefix: Iterable[int]) -> BlockTable:
        """A table starting with shared blocks (a cached prefix): one more reference each."""
        ids = list(prefix)
        pool.ref(ids)
        return cls(pool, max_tokens, ids)

    @property
    def tokens(self) -> int:
        """Positions its blocks hold."""
        return len(self.ids) * self.pool.block_tokens

    def missing(self, tokens: int) -> int:
        """Blocks `ensure(tokens)` would allocate."""
        return max(0, self.pool.blocks_for(tokens) - len(self.ids))

    def ensure(self, tokens: int) -> None:
        """Blocks for positions [0, tokens) (PoolExhausted: none taken; ValueError past max_blocks)."""
        assert not self.freed, "a freed table grows"
        with self.pool.lock:  # two stages' threads: one of them allocates
            need = self.missing(tokens)
            if need == 0:
                return
            if len(self.ids) + need > self.max_blocks:
                raise ValueError(f"{tokens} positions exceed the {self.max_blocks * self.pool.block_tokens} this "
                                 f"sequence was made for")
            self.ids.extend(self.pool.allocate(need))

    def replace_last(self, block: int) -> int:
        """Swap the last block for `block` (which the caller allocated): copy on write of a shared
        partial block. Returns the old id, whose reference this table gave up."""
        old = self.ids[-1]
        self.ids[-1] = block
        self.pool.unref([old])
        return old

    def free(self) -> None:
        """Every reference given back (idempotent)."""
        if not self.freed:
            self.freed = True
            self.pool.unref(self.ids)
            self.ids = []


class KVStorage:
    """A pool's cells for `n_layers` layers on one device: keys and values [L, N * B, Hkv, R]."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, n_blocks: int, block_tokens: int,
                 device: torch.device | str, format: KVFormat):
        self.n_blocks, self.block_tokens, self.format = n_blocks, block_tokens, format
        self.device = torch.device(device)
        cells = n_blocks * block_tokens
        self.k = format.zeros(format.keys, n_layers, cells, n_kv_heads, head_dim, device=self.device)
        self.v = format.zeros(format.values, n_layers, cells, n_kv_heads, head_dim, device=self.device)

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def block_bytes(self) -> int:
        return self.nbytes // self.n_blocks

    def _cells(self, block: int) -> slice:
        return slice(block * self.block_tokens, (block + 1) * self.block_tokens)

    def copy_block(self, src: int, dst: int) -> None:
        """Block src's cells into block dst, every layer (queued on the current stream)."""
        s, d = self._cells(src), self._cells(dst)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]

    def read_block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block's keys and values [L, B, Hkv, R] copied to host RAM (pinned where the device is a GPU;
        queued, not waited for: a later copy on the same stream reads them after)."""
        c = self._cells(block)
        pin = self.device.type == "cuda"
        out = []
        for cells in (self.k[:, c], self.v[:, c]):
            host = torch.empty(cells.shape, dtype=cells.dtype, pin_memory=pin)
            host.copy_(cells, non_blocking=pin)
            out.append(host)
        return out[0], out[1]

    def write_block(self, block: int, data: tuple[torch.Tensor, torch.Tensor]) -> None:
        c = self._cells(block)
        self.k[:, c].copy_(data[0], non_blocking=True)
        self.v[:, c].copy_(data[1], non_blocking=True)


class PagedKV:
    """One sequence's `SequenceKV` over a pool's `storage` through `table` (shared by a split's stages,
    each with its own storage and device copy of the ids). See the module docstring."""

    def __init__(self, storage: KVStorage, table: BlockTable, *, length: int = 0, max_length: int):
        assert table.pool.block_tokens == storage.block_tokens
        self.storage, self.table = storage, table
        self.format: KVFormat = storage.format
        self.block_tokens = storage.block_tokens
        self.length, self.max_length = length, max_length
        assert length <= table.tokens
        # ids on the device, laid out for the table's most blocks: its address never changes, so a
        # captured decode step reads a sequence's new blocks as the sequence grows
        device = storage.device
        self.k, self.v = storage.k, storage.v  # the whole pool's cells
        self._ids = torch.zeros(table.max_blocks, dtype=torch.int32, device=device)
        self.block_table: torch.Tensor | None = self._ids
        self._host_ids = torch.zeros(table.max_blocks, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._synced = 0  # ids [0, _synced) are on the device (queued)
        self._sync()

    @property
    def capacity(self) -> int:
        return self.table.tokens

    @property
    def graph_capturable(self) -> bool:
        return True

    @property
    def offset_writes(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        """The device bytes of its blocks (shared ones counted in full)."""
        return len(self.table.ids) * self.storage.block_bytes

    def _sync(self) -> None:
        """New ids to the device copy, queued (from pinned entries that never change once written: a table
        only grows while its sequence lives)."""
        lo = self._synced
        # one read of the ids: a split's table is shared, and another thread (the engine's, another
        # stage's) may append to it meanwhile; reading its length twice would copy too few ids into
        # a longer range (broadcast: a block's entry holding its neighbour's id) and skip the rest
        new = self.table.ids[lo:]
        if not new:
            return
        hi = lo + len(new)
        self._host_ids[lo:hi] = torch.tensor(new, dtype=torch.int32)
        self._ids[lo:hi].copy_(self._host_ids[lo:hi], non_blocking=True)
        self._synced = hi

    def reserve(self, new_tokens: int) -> None:
        need = self.length + new_tokens
        if need > self.max_length:
            raise ValueError(f"sequence of {need} tokens exceeds the context of {self.max_length}")
        self.table.ensure(need)
        self._sync()

    def cells(self, start: int, stop: int) -> torch.Tensor:
        """Cells [stop - start] (int64, on the device) of positions [start, stop)."""
        b = self.block_tokens
        pos = torch.arange(start, stop, device=self._ids.device)
        return self._ids[pos // b].long() * b + pos % b

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, at: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.length + at
        end = start + k_new.shape[0]
        assert end <= self.capacity, "reserve() before writing"
        f = self.format
        cells = self.cells(start, end)
        self.k[layer].index_copy_(0, cells, f.store(f.keys, k_new).to(self.k.dtype))
        self.v[layer].index_copy_(0, cells, f.store(f.values, v_new).to(self.v.dtype))
        return f.load(f.keys, self.gather(self.k[layer], end)), f.load(f.values, self.gather(self.v[layer], end))

    def gather(self, layer_cells: torch.Tensor, end: int) -> torch.Tensor:
        """A layer's cells [N B, Hkv, R] -> this sequence's positions [0, end) in order (a copy, block by block)."""
        b = self.block_tokens
        n = -(-end // b)
        blocks = layer_cells.view(self.storage.n_blocks, b, *layer_cells.shape[1:])
        return blocks.index_select(0, self._ids[:n].long()).flatten(0, 1)[:end]

    def advance(self, n: int) -> None:
        self.length += n

    def prefetch(self, layer: int) -> None:
        """Every cell is in the pool: nothing to bring."""

    def drain(self) -> None:
        """Nothing in flight."""


class StoragePool:
    """The `KVPool` (engine/runner.py) of one storage: the CPU reference's; a stage's queues the same
    copies on its stream (stage/kv/pool.py)."""

    def __init__(self, blocks: BlockPool, storage: KVStorage):
        assert blocks.n_blocks == storage.n_blocks and blocks.block_tokens == storage.block_tokens
        self.blocks, self.storage = blocks, storage

    @property
    def block_bytes(self) -> int:
        return self.storage.block_bytes

    @property
    def host_tier(self) -> bool:
        return self.storage.device.type != "cpu"

    def copy_block(self, src: int, dst: int) -> None:
        self.storage.copy_block(src, dst)

    def offload(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage.read_block(block)

    def load(self, data: tuple[torch.Tensor, torch.Tensor], block: int) -> None:
        self.storage.write_block(block, data)


class PoolStorages:
    """The storages of a runner's live pools by their bookkeeping (one engine drives a runner, but tests and
    tools may hold an earlier engine's pool while a later one runs): a table's cells are found through
    its pool; a storage whose pool is gone is reused for the next pool of its shape."""

    def __init__(self) -> None:
        self._of: weakref.WeakKeyDictionary[BlockPool, KVStorage] = weakref.WeakKeyDictionary()
        self._spare: list[KVStorage] = []

    def add(self, blocks: BlockPool, make: Callable[[], KVStorage], fits: Callable[[KVStorage], bool]) -> KVStorage:
        live = {id(st) for st in self._of.values()}
        self._spare = [st for st in self._spare if id(st) not in live and fits(st)]
        storage = self._spare.pop() if self._spare else make()
        self._of[blocks] = storage
        self._spare.append(storage)  # reused once its pool is gone
        return storage

    def of(self, blocks: BlockPool) -> KVStorage:
        storage = self._of.get(blocks)
        if storage is None:
            raise ValueError("a block table of a pool this runner did not make")
        return storage


def free_with(owner: object, table: BlockTable) -> None:
    """A table made for a sequence that came without one (tools, tests): its blocks go back when `owner`
    (the sequence) is collected."""
    weakref.finalize(owner, table.free)
