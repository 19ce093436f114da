"""`StatePool`: every sequence's gated DeltaNet state of one decoder, at fixed addresses: per linear
layer one conv tensor [S, C, K - 1] and one recurrent tensor [S, Hv, Dk, Dv] fp32, a sequence's
state one slot (a row of each). A `LinearState` holds a slot; its layer states are views of it and
every update writes it in place, so a decode step can gather B sequences' states by a slot index
tensor [B] and scatter them back (`index_copy_`), and a captured CUDA graph that reads that index
from a buffer serves any sequences (stage/graphs).

Slot 0 is scratch: no sequence holds it; a graph's pad rows and a capture's warm-up step run on it
(their writes land there, duplicates and all). A stage's pool has a fixed number of sequence slots
(`StageOptions.sequences`, --max-running) allocated at build, counted by the memory plan; taking one
more while all are held raises `StatePoolFull`. A pool without a bound (the reference's) doubles
when full, so its tensors may move: hold a slot's views only within one forward.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata_mgpu.model.spec import DeltaNetShape

SCRATCH = 0  # the slot no sequence holds: pad rows and warm-up steps write it
ROW_INDEXES = 64  # slot index tensors a pool keeps, by the slots they hold (as the KV tables are kept)


class StatePoolFull(RuntimeError):
    """Every sequence slot is held: more sequences alive at once than the pool was sized for."""


@dataclass
class LayerState:
    conv: torch.Tensor  # [C, K - 1]: the conv's inputs before the next token, oldest first
    recurrent: torch.Tensor  # [Hv, Dk, Dv] fp32


class StatePool:
    """The DeltaNet states of `layers` (a decoder's local linear layer indexes) for `slots` sequences
    (None: as many as are taken, the pool doubling when full), conv in `dtype`, recurrent fp32."""

    def __init__(self, shape: DeltaNetShape, layers: Sequence[int], slots: int | None, device: torch.device | str,
                 dtype: torch.dtype = torch.float32):
        assert slots is None or slots >= 1, "a pool of no sequence slots"
        self.shape, self.layers, self.device, self.dtype = shape, list(layers), torch.device(device), dtype
        self.bounded = slots is not None
        n = 1 + (slots if slots is not None else 1)  # the scratch slot, then the sequences'
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [S, C, K - 1]
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> [S, Hv, Dk, Dv] fp32
        self._allocate(n)
        self._free = list(range(n - 1, SCRATCH, -1))  # popped lowest first
        self._rows: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    @property
    def sequence_slots(self) -> int:
        return self.n_slots - 1

    @property
    def n_slots(self) -> int:
        return next(iter(self.conv.values())).shape[0] if self.conv else 1

    @property
    def slot_bytes(self) -> int:
        """One slot's bytes, every layer."""
        return sum(self.conv[i][0].nbytes + self.recurrent[i][0].nbytes for i in self.layers)

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def held(self) -> int:
        return self.sequence_slots - len(self._free)

    def _allocate(self, n: int) -> None:
        """Tensors of n slots, the old slots' contents kept."""
        s = self.shape
        for i in self.layers:
            conv = torch.zeros(n, s.conv_dim, s.conv_kernel - 1, device=self.device, dtype=self.dtype)
            recurrent = torch.zeros(n, s.n_v_heads, s.k_head_dim, s.v_head_dim, device=self.device,
                                    dtype=torch.float32)
            if i in self.conv:
                old = self.conv[i].shape[0]
                conv[:old].copy_(self.conv[i])
                recurrent[:old].copy_(self.recurrent[i])
            self.conv[i], self.recurrent[i] = conv, recurrent

    def take(self) -> int:
        """A free sequence slot, zeroed (queued on the current stream: after any work still queued on the
        slot's last holder)."""
        if not self._free:
            gc.collect()  # a dropped sequence in a reference cycle gives its slot back when collected
        if not self._free:
            if self.bounded:
                raise StatePoolFull(f"all {self.sequence_slots} DeltaNet state slots are held by live sequences "
                                    f"(the stage's sequences, --max-running): one more cannot start")
            n = self.n_slots
            self._allocate(2 * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        slot = self._free.pop()
        self.zero(slot)
        return slot

    def give_back(self, slot: int) -> None:
        assert slot != SCRATCH and slot not in self._free, f"slot {slot} given back twice"
        self._free.append(slot)

    def zero(self, slot: int) -> None:
        for i in self.layers:
            self.conv[i][slot].zero_()
            self.recurrent[i][slot].zero_()

    def layer(self, i: int, slot: int) -> LayerState:
        """Views of layer i's state in `slot` (valid until a growing pool grows)."""
        return LayerState(self.conv[i][slot], self.recurrent[i][slot])

    def rows(self, slots: Sequence[int]) -> torch.Tensor:
        """The slot index [B] int64 on the pool's device of a step whose row b continues slots[b]; made
        once per distinct batch and kept (an eager step's host copy only when its batch changes)."""
        key = tuple(slots)
        index = self._rows.get(key)
        if index is None:
            host = torch.tensor(key, dtype=torch.long)
            host = host.pin_memory() if self.device.type == "cuda" else host
            index = self._rows[key] = host.to(self.device, non_blocking=True)
            while len(self._rows) > ROW_INDEXES:
                self._rows.popitem(last=False)
        self._rows.move_to_end(key)
        return index
