"""A device cache of single experts, for decode: the experts a token picks are fetched one by
one from the host arena into the least recently used slots of the VRAM budget's spare room."""

from __future__ import annotations

from collections import OrderedDict

import torch

from strata_mgpu.runtime.device import DeviceContext
from strata_mgpu.runtime.expert_ring import Slot


class ExpertCache:
    def __init__(self, ctx: DeviceContext, slot_bytes: int, n_slots: int):
        assert n_slots >= 1
        self.ctx = ctx
        self.buffer = torch.empty(n_slots, slot_bytes, dtype=torch.uint8, device=ctx.device)
        self.slots = [Slot(i, self.buffer[i], ctx.event(), ctx.event()) for i in range(n_slots)]
        self._where: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, LRU first
        self._free = list(range(n_slots))
        self.hits = self.misses = 0

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def get(self, layer: int, expert: int, src: torch.Tensor, pinned: set[int]) -> Slot:
        """The slot holding (layer, expert), uploading `src` into an evicted slot on a miss.
        Slots in `pinned` (used by the current layer) are never evicted."""
        key = (layer, expert)
        idx = self._where.get(key)
        if idx is not None:
            self._where.move_to_end(key)
            self.hits += 1
            return self.slots[idx]
        self.misses += 1
        if self._free:
            idx = self._free.pop()
        else:
            victim = next((k for k, i in self._where.items() if i not in pinned), None)
            if victim is None:
                raise RuntimeError(f"expert cache: all {len(self.slots)} slots are in use by this layer")
            idx = self._where.pop(victim)
        slot = self.slots[idx]
        n = src.numel()
        if self.ctx.upload is None:
            slot.buffer[:n].copy_(src)
        else:
            with torch.cuda.stream(self.ctx.upload):
                self.ctx.upload.wait_event(slot.free)
                slot.buffer[:n].copy_(src, non_blocking=True)
                slot.ready.record(self.ctx.upload)
        slot.layer = layer
        self._where[key] = idx
        return slot
