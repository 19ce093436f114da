"""A sequence's gated DeltaNet state, beside its KV: per linear layer, the conv's last inputs and
the delta rule's recurrent state, held in one slot of its decoder's `StatePool` (`model.state_pool`).
The KV cache (`SequenceKV`) holds the full-attention layers only; this holds the rest, at the same
token boundary (`length`). `snapshot` / `restore` copy it out at a boundary and back into a fresh
sequence (what a prefix cache of a hybrid model keeps beside its KV blocks; a GPU stage keeps them in
pinned host RAM, `snapshots_on`); `mark` asks the next forwards to record a snapshot at a boundary
inside their rows (a block boundary a prompt's chunk passes), `taken` hands it over.
`HybridSequence` is the two together, as a runner over a hybrid decoder holds them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from strata_mgpu.model.kv_cache import SequenceKV
from strata_mgpu.model.state_pool import LayerState, StatePool

__all__ = ["HybridSequence", "LayerState", "LinearSnapshot", "LinearState"]


@dataclass(frozen=True)
class LinearSnapshot:
    """Copies of every linear layer's state after `length` tokens."""

    length: int
    layers: dict[int, LayerState]

    @property
    def nbytes(self) -> int:
        return sum(s.conv.nbytes + s.recurrent.nbytes for s in self.layers.values())


class LinearState:
    """The DeltaNet state of one sequence: a slot of `pool` (zeros before its first token), given back
    when this is collected. A forward updates each layer's state in place (`layer(i)`: views of the
    slot) and then advances `length` by its rows; one that fails midway leaves some layers past
    `length`, so its sequence is dropped (as the engine drops a failed call's requests) or restored
    from a snapshot. `snapshots_on`: where snapshots are kept (None: beside the state; a GPU stage's in
    host RAM, pinned, each copy queued on the current stream and not waited for: a restore queued
    later on the same stream reads it after)."""

    def __init__(self, pool: StatePool, snapshots_on: torch.device | None = None):
        self.pool = pool
        self.slot = pool.take()  # raises StatePoolFull where a bounded pool has none free
        weakref.finalize(self, pool.give_back, self.slot)
        self.length = 0
        self._keep_on = snapshots_on
        self._marks: set[int] = set()  # boundaries to record as forwards pass them
        self._taken: dict[int, dict[int, LayerState]] = {}  # boundary -> the layers recorded there so far

    @property
    def layers(self) -> list[int]:
        return self.pool.layers

    def layer(self, i: int) -> LayerState:
        return self.pool.layer(i, self.slot)

    @property
    def nbytes(self) -> int:
        return self.pool.slot_bytes

    def advance(self, n: int) -> None:
        self.length += n

    def snapshot(self) -> LinearSnapshot:
        """Copies of the state as it is now, after `length` tokens."""
        return LinearSnapshot(self.length, {i: self._copy(self.layer(i)) for i in self.layers})

    def _copy(self, s: LayerState) -> LayerState:
        if self._keep_on is None or self._keep_on == s.conv.device:
            return LayerState(s.conv.clone(), s.recurrent.clone())
        # a device's state to host RAM: pinned, queued (torch pins a non-blocking copy's host side)
        return LayerState(s.conv.to(self._keep_on, non_blocking=True),
                          s.recurrent.to(self._keep_on, non_blocking=True))

    def mark(self, *boundaries: int) -> None:
        """Record a snapshot after each of these token counts (past `length`) as the forwards pass it."""
        self._marks.update(b for b in boundaries if b > self.length)

    def pending_marks(self) -> list[int]:
        """The boundaries marked and not yet handed over (`taken`)."""
        return sorted(self._marks)

    def cuts(self, first: int, n: int) -> list[int]:
        """The marked boundaries within n rows from token `first` on, as row counts in (0, n]."""
        return sorted(b - first for b in self._marks if first < b <= first + n)

    def record(self, boundary: int, layer: int) -> None:
        """Layer `layer`'s state, which has just taken the tokens up to `boundary`, copied for its snapshot."""
        self._taken.setdefault(boundary, {})[layer] = self._copy(self.layer(layer))

    def taken(self, boundary: int) -> LinearSnapshot | None:
        """The snapshot at a marked boundary once every layer has recorded it (then no longer kept here);
        None before."""
        got = self._taken.get(boundary)
        if got is None or got.keys() != set(self.layers):
            return None
        del self._taken[boundary]
        self._marks.discard(boundary)
        return LinearSnapshot(boundary, got)

    def restore(self, snap: LinearSnapshot) -> None:
        """This state made the snapshot's (the sequence's KV must hold the same `snap.length` tokens)."""
        assert snap.layers.keys() == set(self.layers), "a snapshot of another decoder's layers"
        for i in self.layers:  # from host RAM: queued on the current stream
            s = self.layer(i)
            s.conv.copy_(snap.layers[i].conv, non_blocking=True)
            s.recurrent.copy_(snap.layers[i].recurrent, non_blocking=True)
        self.length = snap.length


@dataclass
class HybridSequence:
    """A hybrid model's sequence in a runner: its KV (the full-attention layers) and its DeltaNet state."""

    kv: SequenceKV
    linear: LinearState

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.linear.nbytes
