"""Which experts stay resident: the most picked ones over the live traffic, an LFU with
exponential decay, re-chosen as decode runs and moved a few experts a step.

Shape legend: L = the stage's layers, E = experts a layer.

`LfuPolicy` is the choice (pure: scores and residency in, swaps out). `Residency` is the
mechanism, called before every decode step (`Stage.refill_cache`), never waiting for the host:
- every PERIOD steps the device's pick counts (`ExpertCache.picks`, which every forward adds to,
  captured graphs included) are flushed to pinned host memory behind an event and zeroed; the
  host's scores decay by 0.5 ** (PERIOD / half_life) and, once a flush has landed, take its counts,
  and the swaps are chosen from them (`ExpertCache.absorb`);
- a step moves at most `swaps_per_step` of them. A swap takes the leaving expert out of the slot
  table first (on the compute stream: later kernels read it from the host arena), the upload
  stream waits for that and copies the entering expert into the freed slot, and only at the next
  step does the compute stream wait for the upload and put the new expert into the table. Both
  experts are read from the arena in between, so every step reads the same bytes whatever the
  residency; the tables change in place (captured graphs read them by address).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from strata_mgpu.stage.experts.cache import ExpertCache

PERIOD = 8  # decode steps between decays of the counts (and host copies of them)


@dataclass(frozen=True)
class Swap:
    layer: int  # local layer index
    out: int  # the resident expert leaving its slot
    into: int  # the expert taking it


@dataclass(frozen=True)
class LfuPolicy:
    """Counts halve every `half_life` steps; an expert outside takes the slot of one inside where its
    count exceeds `margin` times the other's plus `min_count` (near-ties do not churn)."""

    half_life: float
    margin: float = 1.5
    min_count: float = 1.0

    def __post_init__(self) -> None:
        if not (self.half_life > 0 and self.margin >= 1 and self.min_count >= 0):
            raise ValueError(f"LFU: half-life > 0, margin >= 1, min_count >= 0: {self}")

    def decay(self, steps: float) -> float:
        """The factor counts take over `steps` decode steps, in (0, 1]."""
        return float(0.5 ** (steps / self.half_life))

    def swaps(self, counts: np.ndarray, resident: np.ndarray, budget: int) -> list[Swap]:
        """At most `budget` swaps, largest count gains first: in each layer the hottest experts outside
        against the coldest inside, in order. counts [L, E] >= 0, resident [L, E] bool. Applied in
        order, each layer keeps its number of resident experts."""
        found: list[tuple[float, int, int, Swap]] = []
        for i in range(counts.shape[0]):
            inside, outside = np.flatnonzero(resident[i]), np.flatnonzero(~resident[i])
            coldest = inside[np.lexsort((inside, counts[i, inside]))]
            hottest = outside[np.lexsort((outside, -counts[i, outside]))]
            for rank, (e_out, e_in) in enumerate(zip(coldest.tolist(), hottest.tolist(), strict=False)):
                if counts[i, e_in] <= self.margin * counts[i, e_out] + self.min_count:
                    break
                found.append((float(counts[i, e_in] - counts[i, e_out]), rank, i, Swap(i, e_out, e_in)))
        found.sort(key=lambda f: (-f[0], f[1], f[2]))  # a layer's swaps keep their order (gains fall with rank)
        return [f[3] for f in found[:max(0, budget)]]


def hit_share(counts: np.ndarray, resident: np.ndarray) -> float | None:
    """The share of the counted picks that `resident` holds (None: nothing counted)."""
    total = float(counts.sum())
    return min(1.0, float(counts[resident].sum()) / total) if total > 0 else None  # sums round apart


@dataclass
class Residency:
    """The stage's experts kept by `policy`, at most `swaps_per_step` moved a decode step (0: held still,
    the counts and the expected hit rate still followed). `cache` None: nothing to do."""

    cache: ExpertCache | None
    policy: LfuPolicy = field(default_factory=lambda: LfuPolicy(512))
    swaps_per_step: int = 4
    steps: int = 0
    _queued: list[Swap] = field(default_factory=list)  # chosen, not yet started

    @property
    def active(self) -> bool:
        return self.cache is not None and not self.cache.holds_every_expert

    def __call__(self, kvs: Sequence[object] = ()) -> None:
        """Before a decode step of `kvs`, on the compute stream."""
        if not self.active:
            return
        cache = self.cache
        assert cache is not None
        self.steps += 1
        cache.land()
        if self.steps % PERIOD == 0:
            cache.scores *= self.policy.decay(PERIOD)
            cache.flush()
        if cache.absorb() and not self._queued:
            self._choose(cache)
        self._start(cache)

    def _choose(self, cache: ExpertCache) -> None:
        """This round's swaps, from the scores (nothing moving: `land` ran), and the hit rate they make."""
        resident = cache.slot_of_host.numpy() >= 0
        self._queued = (self.policy.swaps(cache.scores, resident, self.swaps_per_step * PERIOD)
                        if self.swaps_per_step > 0 else [])
        after = resident.copy()
        for s in self._queued:
            after[s.layer, s.out], after[s.layer, s.into] = False, True
        hit = hit_share(cache.scores, after)
        if hit is not None:
            cache.expected_hit = hit

    def _start(self, cache: ExpertCache) -> None:
        ctx = cache.ctx
        starting = self._queued[:self.swaps_per_step]
        del self._queued[:len(starting)]
        if not starting:
            return
        slots = [cache.evict(s.layer, s.out) for s in starting]
        freed = ctx.event("expert slots freed")
        ctx.record(freed)  # after every kernel that may still read the leaving experts' slots
        with ctx.use(ctx.upload):
            ctx.wait(freed)
            for s, slot in zip(starting, slots, strict=True):
                src = cache.arena.expert(cache.layers[s.layer], s.into)
                ctx.access(cache.slot_name(slot), "w")
                cache.slots[slot, :src.numel()].copy_(src, non_blocking=True)
                filled = ctx.event("expert slot filled")
                ctx.record(filled)
                cache.moving(s.layer, s.into, slot, filled)

    def settle(self) -> None:
        """The counts so far flushed and every swap they call for made, waiting for the host (tests and
        tools: the residency the counts say, at once)."""
        if not self.active:
            return
        cache = self.cache
        assert cache is not None
        cache.land()
        cache.flush()
        cache.absorb(wait=True)
        self._choose(cache)
        while self._queued:
            self._start(cache)
            cache.land()
