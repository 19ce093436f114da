"""Experts resident in VRAM for decode, and a table saying where every expert can be read.

Experts that fit the budget's spare room live in cache slots; every other expert is read straight
from the pinned host arena through its device mapping (UVA). `slot_of[layer, expert]` (-1: not
resident) and `host_offset` let the device build each expert's address itself, so a decode step
never synchronizes the host.

K experts of every layer stay. Every forward counts each layer's picks on the device, and when a
sequence starts decoding `refill` swaps in experts picked clearly more often than the ones they
replace (a margin and a cap on the bytes moved keep near-ties from churning): trained models
route with locality, which this follows.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.host.arena import HostExpertArena


class ExpertCache:
    """The stage's resident experts and where every other expert is read, the picks counted and the
    refills that follow them."""

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
        self.picks = torch.zeros(len(layers), E, dtype=torch.float32, device=ctx.device)  # [L, E], decayed
        self.swapped = 0  # experts moved into VRAM by refills
        # picks read from VRAM and all picks, counted up to the last `tally` (the host's copy of
        # `picks` then, to take the next tally's new picks from)
        self.vram_picks = self.all_picks = 0.0
        self._tallied = torch.zeros(len(layers), E)
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

    def tally(self, picks: torch.Tensor | None = None) -> tuple[float, float]:
        """Add the picks counted since the last tally to (vram_picks, all_picks) and return them. picks:
        `self.picks` on the host, where the caller has it (else one sync)."""
        if picks is None:
            with self.ctx.on_compute():  # after the forwards that counted them
                picks = self.picks.to("cpu", copy=True)  # a copy on the CPU too: `picks` changes in place
        new = picks - self._tallied  # [L, E]
        self.vram_picks += float((new * (self.slot_of_host >= 0)).sum())
        self.all_picks += float(new.sum())
        self._tallied = picks
        return self.vram_picks, self.all_picks

    def refill(self, margin: float = 1.5, max_share: float = 0.125) -> int:
        """Swap in experts picked more than `margin` times as often as the resident ones they replace, at
        most `max_share` of each layer's slots; then halve the counts. Call on the forwards' stream. One
        host sync. Returns the number of experts moved."""
        if self.per_layer == 0 or self.per_layer == self.arena.spec.n_experts:
            return 0
        picks = self.picks.to("cpu", copy=True)
        self.tally(picks)
        budget = max(1, int(max_share * self.per_layer))
        moved = 0
        resident = self.slot_of_host >= 0
        hottest_outside = torch.where(resident, -1.0, picks).amax(1)  # [L]
        coldest_inside = torch.where(resident, picks, float("inf")).amin(1)
        for i in (hottest_outside > margin * coldest_inside + 1).nonzero().flatten().tolist():
            layer = self.layers[i]
            moved_here = 0
            inside = resident[i].nonzero().flatten().tolist()
            outside = (~resident[i]).nonzero().flatten().tolist()
            coldest = sorted(inside, key=lambda e: (float(picks[i, e]), e))
            hottest = sorted(outside, key=lambda e: (-float(picks[i, e]), e))
            for e_out, e_in in zip(coldest, hottest, strict=False):
                if moved_here >= budget or float(picks[i, e_in]) <= margin * float(picks[i, e_out]) + 1:
                    break
                slot = int(self.slot_of_host[i, e_out])
                src = self.arena.expert(layer, e_in)
                self.slots[slot, :src.numel()].copy_(src, non_blocking=True)
                self.slot_of_host[i, e_out], self.slot_of_host[i, e_in] = -1, slot
                moved_here += 1
            moved += moved_here
        if moved:
            self.slot_of.copy_(self.slot_of_host)  # in place: captured graphs read the same table
            self.swapped += moved
        self.picks.mul_(0.5)
        self._tallied = picks * 0.5  # the same halving, exact in floats
        return moved


class RefillOnFirstStep:
    """Before a sequence's first decode step, the cache follows the routing seen so far. Not before the
    prompt: the moves would share the link with the prefill's stream. One host sync, where the engine
    waits for the prompt's logits anyway."""

    def __init__(self, cache: ExpertCache | None):
        self.cache = cache
        self._decoding: weakref.WeakSet[object] = weakref.WeakSet()  # sequences past their first decode step

    def __call__(self, kvs: Sequence[object]) -> None:
        new = [kv for kv in kvs if kv not in self._decoding]
        if self.cache is not None and new:
            self.cache.refill()
        self._decoding.update(new)


def vram_share(caches: Sequence[ExpertCache], from_vram: float, picks: float) -> float | None:
    """The share of `picks` read from VRAM, by `caches`' tallies: 1 where every cache holds every
    expert, None where there were no caches or no picks."""
    if picks:
        return from_vram / picks
    return 1.0 if caches and all(c.holds_every_expert for c in caches) else None
