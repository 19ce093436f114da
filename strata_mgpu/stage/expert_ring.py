"""The device expert ring: a few slots, each able to hold one layer's experts.

Uploads run on the upload stream, ahead of compute. Contract: a slot is overwritten only after
the event of its last reader has completed (`release` records it on the reader's stream, the next
upload into the slot waits for it); a reader waits on the slot's ready event (`acquire`). Nothing
here synchronizes the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.streams import Event


@dataclass
class Slot:
    index: int
    buffer: torch.Tensor  # uint8 [slot_bytes] on the device
    ready: Event  # recorded on the upload stream after the copy
    free: Event  # recorded on the reader's stream after its last read
    layer: int | None = None

    def acquire(self, ctx: DeviceContext) -> torch.Tensor:
        """Make the current stream wait for the slot's upload; returns its buffer."""
        ctx.wait(self.ready)
        ctx.access(self.buffer, "r")
        return self.buffer

    def release(self, ctx: DeviceContext) -> None:
        """The current stream has issued its last read of the slot."""
        ctx.record(self.free)


class ExpertRing:
    def __init__(self, ctx: DeviceContext, slot_bytes: int, n_slots: int = 2):
        assert n_slots >= 1 and slot_bytes > 0
        self.ctx = ctx
        buffers = [ctx.label(torch.empty(slot_bytes, dtype=torch.uint8, device=ctx.device), f"ring slot {i}")
                   for i in range(n_slots)]
        self.slots = [Slot(i, b, ctx.event(f"ring slot {i} ready"), ctx.event(f"ring slot {i} free"))
                      for i, b in enumerate(buffers)]
        self._next = 0
        self.uploaded_bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() for s in self.slots)

    def upload(self, layer: int, src: torch.Tensor) -> Slot:
        """Queue `src` (pinned host bytes of one layer) into the next slot; returns it at once."""
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        n = src.numel()
        assert n <= slot.buffer.numel(), f"layer {layer}: {n} bytes exceed the slot's {slot.buffer.numel()}"
        with self.ctx.use(self.ctx.upload):
            self.ctx.wait(slot.free)  # its last reader is done with the old layer
            self.ctx.access(slot.buffer, "w")
            slot.buffer[:n].copy_(src, non_blocking=True)
            self.ctx.record(slot.ready)
        slot.layer = layer
        self.uploaded_bytes += n
        return slot


class LayerFeed:
    """One pass over `count` layers through a ring, `len(ring.slots)` layers ahead of compute.

    `source(i)` gives local layer i's (global id, pinned bytes). `acquire(i)` waits for layer i's
    upload; `release(i)` marks its last read and queues layer i + len(slots) into the freed slot
    (queued only after the release, so the upload waits for that read).
    """

    def __init__(self, ring: ExpertRing, count: int, source: Callable[[int], tuple[int, torch.Tensor]]):
        self.ring, self.count, self.source = ring, count, source
        self._slots: dict[int, Slot] = {}
        for i in range(min(len(ring.slots), count)):
            self._upload(i)

    def _upload(self, i: int) -> None:
        layer, src = self.source(i)
        self._slots[i] = self.ring.upload(layer, src)

    def acquire(self, i: int) -> torch.Tensor:
        return self._slots[i].acquire(self.ring.ctx)

    def release(self, i: int) -> None:
        self._slots.pop(i).release(self.ring.ctx)
        ahead = i + len(self.ring.slots)
        if ahead < self.count:
            self._upload(ahead)
