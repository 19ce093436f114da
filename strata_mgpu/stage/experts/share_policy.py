"""How much of a gathered pass's missing experts the host's cores take.

`--cpu-experts F` fixes the share; `auto` takes it from measured rates (the host's cost of a
request against the link's, at the expert cache's hit rate, retuned every RETUNE_STEPS) and
declines where the host's fixed cost outweighs what it would take off the link. A model of rates
does not see what the host's reads cost the GPU's (the same RAM), so `auto` then checks its share
by the clock (`ShareTrial`) and keeps it only where steps with the host are shorter.
`assign_host` is which picks a share sends, as the kernel chooses them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from strata_mgpu.kernels.cpu_experts import CpuExperts
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.stage.host.arena import HostExpertArena

AUTO_MIN_SHARE = 0.1  # `auto` below this share is not worth a round trip a layer: it declines
RETUNE_STEPS = 256  # `auto` refits the host's rate to its answered requests every this many decode steps
RETUNE_SAMPLES = 512  # requests it keeps for that (the latest)
# `auto` then checks its share by the clock (`ShareTrial`): blocks of TRIAL_BLOCK decode steps with the host
# and without it, TRIAL_BLOCKS of each, interleaved, the first TRIAL_SKIP steps of a block not counted. Step n's
# time is the interval between the arms of steps n + 1 and n + 2 (TRIAL_LAG): the engine queues step n + 1,
# then waits for step n - 1's tokens, so the arm of n + 2 comes as step n ends.
TRIAL_BLOCK, TRIAL_BLOCKS, TRIAL_SKIP, TRIAL_LAG = 8, 6, 2, 2
TRIAL_STEPS = 2 * TRIAL_BLOCKS * TRIAL_BLOCK
TRIAL_EVERY_STEPS = 16 * RETUNE_STEPS  # a kept share is tried again this often (the first: at the first retune)
TRIAL_MARGIN = 0.03  # the host must save more than this of a step: the steps without it still run its two kernels
ROUND_TRIP_S = 30e-6  # the mailbox's: the GPU's writes seen by the polling worker, its answer seen by the GPU
PROBE_REPEATS = 6


@dataclass(frozen=True)
class HostRate:
    """What a request to the host's cores costs: a fixed part (waking the pool, the graph, the
    mailbox's round trip) and its experts' bytes at `bytes_per_s`."""

    overhead_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.overhead_s + nbytes / self.bytes_per_s

    def refit(self, samples: list[tuple[int, float]]) -> HostRate:
        """The rate the worker's answered requests (bytes, seconds) show: a line through them where their
        sizes differ enough, else this bytes/s with the fixed part they leave. Decode measures what a
        probe cannot: the GPU reading the same RAM meanwhile."""
        nbytes = np.array([b for b, _ in samples], dtype=np.float64)
        seconds = np.array([t for _, t in samples], dtype=np.float64)
        if nbytes.max() >= 1.5 * max(nbytes.min(), 1.0):
            slope, overhead = np.polyfit(nbytes, seconds, 1)
            if slope > 0 and overhead >= 0:
                return HostRate(float(overhead), float(1 / slope))
        return HostRate(max(0.0, float(np.mean(seconds - nbytes / self.bytes_per_s))), self.bytes_per_s)


@dataclass(frozen=True)
class AutoShare:
    """`--cpu-experts auto`'s inputs: the host's measured rate, the link's, one expert's bytes and
    the picks a decode row makes a layer."""

    host: HostRate
    link_bytes_per_s: float
    expert_bytes: int
    n_used: int

    def share(self, hit_rate: float) -> float:
        """The share f of a layer's misses m the host computes to finish with the link:
        (1 - f) m b / link = overhead + f m b / host; 0 below AUTO_MIN_SHARE."""
        link_s = self.n_used * (1 - hit_rate) * self.expert_bytes / self.link_bytes_per_s
        host_s = self.n_used * (1 - hit_rate) * self.expert_bytes / self.host.bytes_per_s
        if link_s <= 0:
            return 0.0
        f = min(1.0, (link_s - self.host.overhead_s) / (link_s + host_s))
        return f if f >= AUTO_MIN_SHARE else 0.0

    def prompt_experts(self, streamed: int) -> int:
        """Of a few-row prompt pass's `streamed` experts a layer, how many the host computes to finish with
        the link: (S - n) b / link = overhead + n b / host; 0 below AUTO_MIN_SHARE."""
        per_link, per_host = self.expert_bytes / self.link_bytes_per_s, self.expert_bytes / self.host.bytes_per_s
        n = int((streamed * per_link - self.host.overhead_s) / (per_link + per_host))
        return n if n >= AUTO_MIN_SHARE * streamed else 0


class ShareTrial:
    """`auto`'s share checked by the clock: decode steps run in blocks, alternately at the share and
    at 0; after TRIAL_BLOCKS of each, the share stays only where the median step with the host is
    shorter by more than TRIAL_MARGIN, else 0. `step(now)` (perf_counter seconds) is called at each
    arm and answers the share of the step about to be queued, or None once decided (`verdict`)."""

    def __init__(self, share: float):
        assert share > 0
        self.share = share
        self.times: dict[bool, list[float]] = {True: [], False: []}  # with the host -> its steps' seconds
        self.verdict: float | None = None
        self.medians: tuple[float, float] = (0.0, 0.0)  # seconds a step, with the host and without (decided)
        self._n = 0  # steps queued within the trial
        self._last: float | None = None

    def step(self, now: float) -> float | None:
        if self.verdict is not None:
            return None
        n = self._n  # the step about to be queued, counted from the trial's first
        ran = n - TRIAL_LAG  # the step whose time ends now
        if self._last is not None and 0 <= ran < TRIAL_STEPS and ran % TRIAL_BLOCK >= TRIAL_SKIP:
            self.times[self._with_host(ran)].append(now - self._last)
        self._last = now
        if ran == TRIAL_STEPS - 1:
            with_host, without = self.medians = (statistics.median(self.times[True]),
                                                 statistics.median(self.times[False]))
            self.verdict = self.share if with_host < (1 - TRIAL_MARGIN) * without else 0.0
            return None
        self._n += 1
        return self.share if self._with_host(n) else 0.0

    @staticmethod
    def _with_host(step: int) -> bool:
        return (step // TRIAL_BLOCK) % 2 == 1 or step >= TRIAL_STEPS


def assign_host(experts: list[int], resident: np.ndarray, share: float, carry: float) -> tuple[set[int], float]:
    """Which experts of a pass's picks (in pick order) the host computes, and the carry after them:
    each missing expert, once, adds `share` to the carry and goes to the host when it reaches one.
    cpu_handover.cu's handover_send makes the same choices (in fp32)."""
    host: set[int] = set()
    seen: set[int] = set()
    c = np.float32(carry)
    for e in experts:
        if e in seen:
            continue
        seen.add(e)
        if resident[e]:
            continue
        c = np.float32(c + np.float32(share))
        if c >= 1:
            c = np.float32(c - 1)
            host.add(e)
    return host, float(c)


def probe_host_rate(executor: CpuExperts, arena: HostExpertArena, layer: int, n_used: int, d: int,
                    repeats: int = PROBE_REPEATS) -> HostRate:
    """The host's cost of a request on `layer` at one row: median times with 1 pick and with `n_used`
    (fresh experts every call, as in decode), a line through the two, plus the mailbox's round trip."""
    lay: ExpertLayout = arena.layouts[layer]
    n_experts = arena.spec.n_experts
    h = torch.randn(1, d)
    order = torch.randperm(n_experts)
    start = 0

    def median_s(k: int) -> float:
        nonlocal start
        times = []
        for rep in range(repeats + 2):
            picks = order[(torch.arange(k) + start) % n_experts].view(1, k)
            start += k
            t0 = time.perf_counter()
            executor.moe(arena.layer(layer), lay, h, torch.full((1, k), 1.0 / k), picks)
            if rep >= 2:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    one, many = median_s(1), median_s(max(n_used, 2))
    executor.reset_rates()
    per_expert = max((many - one) / (max(n_used, 2) - 1), 1e-9)
    return HostRate(overhead_s=max(0.0, one - per_expert) + ROUND_TRIP_S, bytes_per_s=lay.expert_bytes / per_expert)
