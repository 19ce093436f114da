"""The device expert ring: a few slots, each able to hold the streamed experts of one layer.

Uploads run on the upload stream, ahead of compute. Contract: a slot is overwritten only after
the event of its last reader has completed (`release` records it on the reader's stream, the next
upload into the slot waits for it); a reader waits on the slot's ready event (`acquire`). Nothing
here synchronizes the host. One pass (a `LayerFeed`) holds the ring at a time: the busy stage's
own prompt, or the helper it is lent to, never both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.streams import Event


@dataclass
class Slot:
    index: int
    buffer: torch.Tensor  # uint8 [slot_bytes] on the device
    ready: Event  # recorded on the upload stream after the copies
    free: Event  # recorded on the reader's stream after its last read
    layer: int | None = None

    def acquire(self, ctx: DeviceContext) -> torch.Tensor:
        """Make the current stream wait for the slot's upload; returns its buffer."""
        ctx.wait(self.ready)
        ctx.access(self.buffer, "r")
        return self.buffer

    def release(self, ctx: DeviceContext) -> None:
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
        self.holder: LayerFeed | None = None  # the pass going through the ring now

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() for s in self.slots)

    @property
    def slot_bytes(self) -> int:
        return self.slots[0].buffer.numel()

    def claim(self, feed: LayerFeed) -> int:
        """`feed` starts a pass; returns the slot its first upload will take."""
        assert self.holder is None or self.holder.done, \
            "the expert ring is lent to one pass at a time (a helper and its stage overlapped)"
        self.holder = feed
        return self._next

    def upload(self, layer: int, runs: Sequence[torch.Tensor]) -> Slot:
        """Queue `runs` (pinned host bytes of one layer's streamed experts) packed into the next slot;
        returns it at once."""
        slot = self.advance()
        n = sum(r.numel() for r in runs)
        assert n <= slot.buffer.numel(), f"layer {layer}: {n} bytes exceed the slot's {slot.buffer.numel()}"
        with self.ctx.use(self.ctx.upload):
            self.ctx.wait(slot.free)  # its last reader is done with the old layer
            self.ctx.access(slot.buffer, "w")
            self._copy(slot, runs)
            self.ctx.record(slot.ready)
        slot.layer = layer
        self.uploaded_bytes += n
        return slot

    def advance(self) -> Slot:
        """The next slot, as `upload` would take it, with nothing copied into it."""
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot

    @staticmethod
    def _copy(slot: Slot, runs: Sequence[torch.Tensor]) -> None:
        at = 0
        for r in runs:
            slot.buffer[at:at + r.numel()].copy_(r, non_blocking=True)
            at += r.numel()


class LayerFeed:
    """One pass over `count` layers through a ring, `len(ring.slots)` uploading layers ahead of compute.

    `source(i)` gives local layer i's (global id, runs of pinned bytes); a layer with nothing to
    stream takes no slot. `slot_of[i]` is known before its upload (so address tables can be built for
    the whole pass at once). `release(i)` queues the next layer's upload after the read it marks.
    """

    def __init__(self, ring: ExpertRing | None, count: int,
                 source: Callable[[int], tuple[int, Sequence[torch.Tensor]]]):
        self.ring = ring
        self._runs = [source(i) for i in range(count)]
        self.bytes = sum(r.numel() for _, runs in self._runs for r in runs)  # what the pass streams
        uploading = [i for i in range(count) if any(r.numel() for r in self._runs[i][1])]
        assert ring is not None or not uploading, "experts to stream, but the stage has no ring"
        self.slot_of: dict[int, Slot] = {}
        self._queue = uploading  # layers still to upload, in order
        self._ahead = 0  # how many of them are queued
        self._slots: dict[int, Slot] = {}
        self.done = not uploading
        if ring is None or not uploading:
            return
        first = ring.claim(self)
        n = len(ring.slots)
        for k, i in enumerate(uploading):
            self.slot_of[i] = ring.slots[(first + k) % n]
        for _ in range(min(n, len(uploading))):
            self._upload_next()

    @property
    def _ring(self) -> ExpertRing:
        assert self.ring is not None, "only a pass with a ring uploads or holds slots"
        return self.ring

    def _upload_next(self) -> None:
        i = self._queue[self._ahead]
        self._ahead += 1
        layer, runs = self._runs[i]
        slot = self._ring.upload(layer, runs)
        assert slot is self.slot_of[i]
        self._slots[i] = slot

    def acquire(self, i: int) -> torch.Tensor | None:
        slot = self._slots.get(i)
        return slot.acquire(self._ring.ctx) if slot is not None else None

    def abort(self) -> None:
        """The pass failed partway: the reads it queued on the current stream become the last of every slot
        it holds, nothing more is queued, and the ring is given back."""
        for slot in self._slots.values():
            slot.release(self._ring.ctx)
        self._slots.clear()
        self._queue = self._queue[:self._ahead]
        self.done = True

    def release(self, i: int) -> None:
        slot = self._slots.pop(i, None)
        if slot is None:
            return
        slot.release(self._ring.ctx)
        if self._ahead < len(self._queue):
            self._upload_next()
        elif not self._slots:
            self.done = True
