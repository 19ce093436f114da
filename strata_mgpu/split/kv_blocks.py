"""A split's KV: a sequence's caches, one a stage (`SplitKV`), and its prefix-cache blocks: each
stage keeps its own layers' part of every block, on its own device; a block is the tuple of the
stages' parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from strata_mgpu.model.kv_cache import SequenceKV
from strata_mgpu.stage.kv.blocks import StageBlocks

SplitBlock = tuple[torch.Tensor, ...]  # one part a stage, in stage order


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


class SplitBlocks:
    """`KVBlocks` of a split's sequences, from each stage's own."""

    def __init__(self, parts: list[StageBlocks]):
        assert parts and len({p.block_tokens for p in parts}) == 1
        self.parts = parts

    @property
    def block_tokens(self) -> int:
        return self.parts[0].block_tokens

    @property
    def block_bytes(self) -> int:
        return sum(p.block_bytes for p in self.parts)

    @property
    def host_tier(self) -> bool:
        """Where any stage is a GPU: a CPU stage's part then simply stays where it is."""
        return any(p.host_tier for p in self.parts)

    def cacheable(self, kv: SplitKV) -> bool:
        return all(p.cacheable(part) for p, part in zip(self.parts, kv.parts, strict=True))

    def save(self, kv: SplitKV, index: int) -> SplitBlock:
        return tuple(p.save(part, index) for p, part in zip(self.parts, kv.parts, strict=True))

    def offload(self, block: SplitBlock) -> SplitBlock:
        return tuple(p.offload(b) if p.host_tier else b for p, b in zip(self.parts, block, strict=True))

    def load(self, kv: SplitKV, blocks: Sequence[SplitBlock], n_tokens: int) -> None:
        for k, (p, part) in enumerate(zip(self.parts, kv.parts, strict=True)):
            p.load(part, [b[k] for b in blocks], n_tokens)
