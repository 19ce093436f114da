"""Experts resident in VRAM for decode, and a table saying where every expert can be read.

Experts that fit the budget's spare room live in cache slots; every other expert is read straight
from the pinned host arena through its device mapping (UVA). `slot_of[layer, expert]` (-1: not
resident) and `host_offset` let the device build each expert's address itself, so a decode step
never synchronizes the host.

K experts of every layer stay. Every forward counts each layer's picks on the device; which K
follows those counts as decode runs (`residency.Residency`: an LFU with decay, a few experts moved
a step through `evict` and `admit`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from strata_mgpu.stage.device import DeviceContext, HostCopy
from strata_mgpu.stage.host.arena import HostExpertArena
from strata_mgpu.stage.streams import Event


class ExpertCache:
    """The stage's resident experts and where every other expert is read, and the picks counted (on the
    device, flushed to the host)."""

    def __init__(self, ctx: DeviceContext, arena: HostExpertArena, layers: range, n_slots: int):
        E = arena.spec.n_experts
        self.ctx = ctx
        self.layers = layers
        self.slot_bytes = arena.max_expert_bytes
        per_layer = min(E, n_slots // len(layers))
        self.slots = torch.empty(per_layer * len(layers), self.slot_bytes, dtype=torch.uint8, device=ctx.device)
        slot_of = torch.full((len(layers), E), -1, dtype=torch.int64)
        host_offset = torch.empty(len(layers), E, dtype=torch.int64)
        for i, layer in enumerate(layers):
            for e in range(E):
                host_offset[i, e] = arena.offsets[layer] + e * arena.layouts[layer].expert_bytes
            for e in range(per_layer):
                slot = i * per_layer + e
                src = arena.expert(layer, e)
                self.slots[slot, :src.numel()].copy_(src)
                slot_of[i, e] = slot
        self.per_layer = per_layer
        self.slot_of_host = slot_of
        self.slot_of = slot_of.to(ctx.device)  # [L, E]
        self.host_offset = host_offset.to(ctx.device)  # [L, E] bytes from the arena's start
        self.arena = arena
        self.lookups = self.hits = 0  # counted by the torch twin path
        self.picks = torch.zeros(len(layers), E, dtype=torch.float32, device=ctx.device)  # [L, E], since the last flush
        self.swapped = 0  # experts moved into VRAM since load
        # the share of picks the resident experts are expected to take, by the decayed counts (K / E before
        # any): what a pass's break-even reads on the host (`break_even`), set by the residency
        self.expected_hit = per_layer / E
        # the picks flushed to the host so far: read from VRAM (under the residency when they landed), all,
        # and each expert's (the LFU's scores: decayed by the residency); flushes on their way
        self.vram_picks = self.all_picks = 0.0
        self.scores = np.zeros((len(layers), E))
        self._flushing: list[HostCopy] = []
        self._moving: list[tuple[int, int, int, Event]] = []  # (layer, expert, slot, its upload's event)
        self._one = torch.ones(1, dtype=self.picks.dtype, device=ctx.device)  # a pick's count, viewed as many

    @property
    def host(self) -> torch.Tensor:
        return self.arena.buffer

    @property
    def n_slots(self) -> int:
        return self.slots.shape[0]

    @property
    def hit_rate_uniform(self) -> float:
        return self.per_layer / self.arena.spec.n_experts

    def slot(self, index: int) -> torch.Tensor:
        return self.slots[index]

    def source(self, i: int, e: int) -> torch.Tensor:
        slot = int(self.slot_of_host[i, e])
        self.lookups += 1
        if slot >= 0:
            self.hits += 1
            return self.slots[slot]
        return self.arena.expert(self.layers[i], e)

    def addresses(self, i: int, picks: torch.Tensor) -> torch.Tensor:
        """Device addresses (uint64 as int64) of the experts `picks` [M] of local layer i, built on the device."""
        slot = self.slot_of[i, picks]
        cached = self.slots.data_ptr() + slot.clamp(min=0) * self.slot_bytes
        host = self.host.data_ptr() + self.host_offset[i, picks]
        return torch.where(slot >= 0, cached, host)

    @property
    def holds_every_expert(self) -> bool:
        return self.per_layer == self.arena.spec.n_experts

    def observe(self, i: int, experts: torch.Tensor) -> None:
        """Count local layer i's picks [T, A] (a device op; never synchronizes)."""
        if self.holds_every_expert:
            return
        flat = experts.reshape(-1)
        # one tensor for every call, never replaced: a captured decode graph reads it at its address
        self.picks[i].index_add_(0, flat, self._one.expand(flat.numel()))  # one launch

    def flush(self) -> None:
        """Queue the counts since the last flush to the host and zero them on the device, on the current
        stream (after the forwards that counted them); they are added to the totals as they land."""
        self._flushing.append(HostCopy(self.picks))
        self.picks.zero_()  # in place, after the copy on the same stream: no pick lost or counted twice

    def absorb(self, wait: bool = False) -> bool:
        """Add the flushes that have landed (every one, waiting, with `wait`) to the totals and scores; True
        where any did. Never waits without `wait`."""
        landed = False
        while self._flushing and (wait or self._flushing[0].ready()):
            counts = self._flushing.pop(0).wait().double().numpy()  # [L, E]
            self.vram_picks += float(counts[self.slot_of_host.numpy() >= 0].sum())
            self.all_picks += float(counts.sum())
            self.scores += counts
            landed = True
        return landed

    def tally(self) -> tuple[float, float]:
        """(vram_picks, all_picks) with every pick counted so far: a flush, waited for (one host sync)."""
        if not self.holds_every_expert:
            with self.ctx.on_compute():
                self.flush()
            self.absorb(wait=True)
        return self.vram_picks, self.all_picks

    def evict(self, i: int, e: int) -> int:
        """Expert e of local layer i is read from the host arena from the next kernel queued on the
        current stream on; returns the slot it held (free once that stream's earlier work is done)."""
        slot = int(self.slot_of_host[i, e])
        assert slot >= 0, f"expert {e} of local layer {i} is not resident"
        self.slot_of_host[i, e] = -1
        self.slot_of[i, e].fill_(-1)  # a fill with its value as an argument: no copy from the host
        self.ctx.access(self.slot_name(slot), "r")  # (the twin's) the last kernels reading its old expert
        return slot

    def moving(self, i: int, e: int, slot: int, filled: Event) -> None:
        """Expert e of local layer i is on its way into `slot` (`filled` recorded after its upload): in
        the table at the next `land`."""
        self._moving.append((i, e, slot, filled))

    def land(self) -> None:
        """The experts on their way into the table, the current stream ordered after their uploads (a
        device-side wait): before each decode step, and before a pass that streams, whose ring holds
        the E - K experts a layer that are not resident and no more."""
        for i, e, slot, filled in self._moving:
            self.ctx.wait(filled)
            self.admit(i, e, slot)
        self._moving = []

    def admit(self, i: int, e: int, slot: int) -> None:
        """Expert e of local layer i, its bytes now in `slot` (the current stream ordered after their
        upload), is read from there from the next kernel on."""
        assert int(self.slot_of_host[i, e]) < 0 and not bool((self.slot_of_host == slot).any()), "slot taken"
        self.ctx.access(self.slot_name(slot), "r")  # (the twin's) the first kernels reading its new expert
        self.slot_of_host[i, e] = slot
        self.slot_of[i, e].fill_(slot)
        self.swapped += 1

    def slot_name(self, slot: int) -> str:
        """How the ordering twin knows slot `slot` (the kernels' reads of it are declared where the table
        changes: at `evict` and `admit`)."""
        return f"{self.ctx.name} expert slot {slot}"


def vram_share(caches: Sequence[ExpertCache], from_vram: float, picks: float) -> float | None:
    """The share of `picks` read from VRAM, by `caches`' tallies: 1 where every cache holds every
    expert, None where there were no caches or no picks."""
    if picks:
        return from_vram / picks
    return 1.0 if caches and all(c.holds_every_expert for c in caches) else None
