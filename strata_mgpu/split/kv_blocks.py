"""A split's KV: a sequence's caches, one a stage (`SplitKV`), and its pool (`SplitPool`): one
bookkeeping of blocks for all stages, each stage holding every block's cells of its own layers on
its own device; a block's copies run on every stage, a block offloaded is the tuple of the stages'
parts.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from strata_mgpu.model.kv_cache import SequenceKV
from strata_mgpu.model.kv_pool import BlockPool
from strata_mgpu.stage.kv.pool import StagePool

HostBlock = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # a stage's keys and values, in stage order


@dataclass
class SplitKV:
    """One sequence's KV caches, one per stage (each on its stage's device)."""

    parts: list[SequenceKV]
    pending: list[list[Future]] = field(default_factory=list)  # its prompt chunks' stage tasks, not waited for

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def take_pending(self) -> list[Future]:
        """Its chunks' tasks not yet waited for, handed to the caller who waits for them."""
        tasks, self.pending = [f for job in self.pending for f in job], []
        return tasks

    @property
    def length(self) -> int:
        return self.parts[0].length


class SplitPool:
    """The `KVPool` of a split: the stages' pools over one `BlockPool`."""

    def __init__(self, parts: list[StagePool]):
        assert parts and all(p.blocks is parts[0].blocks for p in parts)
        self.parts = parts

    @property
    def blocks(self) -> BlockPool:
        return self.parts[0].blocks

    @property
    def block_bytes(self) -> int:
        return sum(p.block_bytes for p in self.parts)

    @property
    def host_tier(self) -> bool:
        """Where any stage is a GPU (a CPU stage's part is copied within host RAM)."""
        return any(p.host_tier for p in self.parts)

    def copy_block(self, src: int, dst: int) -> None:
        for p in self.parts:
            p.copy_block(src, dst)

    def offload(self, block: int) -> HostBlock:
        return tuple(p.offload(block) for p in self.parts)

    def load(self, data: HostBlock, block: int) -> None:
        for p, part in zip(self.parts, data, strict=True):
            p.load(part, block)
