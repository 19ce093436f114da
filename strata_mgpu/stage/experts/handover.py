"""A gathered pass's missing experts shared with the host's cores: while the GPU computes the picks
resident in VRAM (and the misses the link brings), the host computes a share of the misses from the
pinned arena through ggml (`kernels.cpu_experts`), and the GPU adds its sums.

Shape legend: T = rows of the pass, A = picks a row, D = hidden, E = experts a layer.

The protocol, per layer of a decode step (or a short prompt's gathered pass) of at most MAX_ROWS
rows; `cuda_src/cpu_handover.cu` is the GPU's side:

1. `handover_send` (one launch on the stage's compute stream) marks each pick for the GPU or the
   host: a resident expert stays; a missing one goes to the host while a running carry of the share
   says so (so `share` of the misses go, pick by pick, across layers and steps). Where the host
   takes any, the picks, weights and rows go into the `Mailbox` in mapped host memory and the
   request number is bumped. The GPU's picks come back with the host's set to -1.
2. The fused decode kernels compute the GPU's picks (a -1 adds nothing).
3. The host's `HandoverWorker` thread, polling the request number, computes the host's picks of
   the rows that have any, writes their sums [T, D] fp32 and then the done number.
4. `handover_add` waits until done equals the request and adds the host's sums.

No step waits on the host's side of CUDA, so a decode step with hand-overs is still captured and
replayed as one graph. The worker spins while steps are in flight (`arm` before each, then
IDLE_SPIN_S after the last request) and otherwise checks the request number every IDLE_POLL_S, so
a request queued behind long work (a prompt chunk before the decode step) is answered late, never
missed. A worker that fails answers with zeros and sets the share to 0, so later layers give the
host nothing; a host that does not answer within TIMEOUT_S sets the status word, and every later
wait returns at once. The layer that met the failure lacks the host's part: `silent_faults` counts
the failure, and the engine fails the requests of every step in flight then (their tokens and KV
may be wrong); the next `arm` reports it in the log and the stage detaches the hand-over (link
only from then on). The flags are plain loads and stores on the host's side, which
x86 keeps in order (the build refuses other hosts).

`share`: `--cpu-experts F` fixes it (`config.HostShare`); `auto` (`AutoShare`) takes it from
measured rates, a request's cost on the host's cores (`probe_host_rate`: a fixed part and its
experts' bytes/s) against the link's, at the hit rate the expert cache sees (`retune`, every
RETUNE_STEPS decode steps), and declines where the host's fixed cost outweighs what it would take off the link
(AUTO_MIN_SHARE). A model of rates does not see what the host's reads cost the GPU's (the same RAM),
so after the first retune `auto` tries its share by the clock (`ShareTrial`: decode steps with and
without the host, interleaved) and keeps it only where the steps with the host are shorter, trying
again every TRIAL_EVERY_STEPS; `off` builds none of this. `HandoverTwin` is the same arithmetic on a
CPU stage's device-path twins, for tests: picks chosen as the kernel chooses them, the host's sums
computed at once.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import torch

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.cpu_experts import CpuExperts, RateCounter
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.experts.parts import LayerPart
from strata_mgpu.stage.host.arena import HostExpertArena
from strata_mgpu.stage.host.pinned import host_buffer

log = logging.getLogger("strata.stage")
T = TypeVar("T")
HANDOVER_FILE = "cpu_handover.cu"
KERNELS = ("handover_send", "handover_add", "handover_rows", "handover_send_fixed")
SEND_THREADS = 512
ADD_BLOCKS, ADD_THREADS = 16, 256  # handover_add: few blocks, each polling the done number once
ROWS_BLOCKS = 64  # handover_rows: a prompt's rows into the mailbox
MAX_ROWS = 64  # rows a hand-over takes: decode batches and short prompts; a larger pass stays on the GPU
MAX_EXPERTS = 4096  # cpu_handover.cu's table of where each expert of a layer goes
TIMEOUT_S = 30.0  # a host that has not answered by then has failed (its first call may build ggml graphs)
IDLE_SPIN_S = 0.25  # the worker spins this long after the last step was armed or answered ...
IDLE_POLL_S = 1e-3  # ... then checks the request number this often
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
HANDOVER_POLL = 50  # ggml's polling level for the hand-over's pool: requests come a layer (~0.1 ms) apart
PROBE_REPEATS = 6
# The worker is a Python thread: while the engine's thread runs Python (queuing the next step), a
# request waits for the GIL up to the interpreter's switch interval (5 ms by default, the length of
# a whole decode step). A stage with a hand-over lowers it for the process to this.
SWITCH_INTERVAL_S = 5e-5


@dataclass(frozen=True)
class HostRate:
    """What a request to the host's cores costs: a fixed part (waking the pool, the graph, the
    mailbox's round trip) and its experts' bytes at `bytes_per_s`."""

    overhead_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.overhead_s + nbytes / self.bytes_per_s

    def refit(self, samples: list[tuple[int, float]]) -> HostRate:
        """The rate the worker's answered requests (bytes, seconds) show: a line through them where
        their sizes differ enough, else this rate's bytes/s with the fixed part they leave. Decode
        measures what a probe alone cannot: the GPU reading the misses from the same RAM meanwhile,
        the engine's thread beside the pool's."""
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
    the picks a decode row makes a layer (`share` weighs them at a hit rate)."""

    host: HostRate
    link_bytes_per_s: float
    expert_bytes: int
    n_used: int

    def share(self, hit_rate: float) -> float:
        """The share of a layer's misses (n_used x (1 - hit_rate) at batch 1) the host computes so that
        it finishes with the link: (1 - f) m b / link = overhead + f m b / host; 0 where that is below
        AUTO_MIN_SHARE (a host whose fixed cost outweighs what it would take off the link)."""
        link_s = self.n_used * (1 - hit_rate) * self.expert_bytes / self.link_bytes_per_s
        host_s = self.n_used * (1 - hit_rate) * self.expert_bytes / self.host.bytes_per_s
        if link_s <= 0:
            return 0.0
        f = min(1.0, (link_s - self.host.overhead_s) / (link_s + host_s))
        return f if f >= AUTO_MIN_SHARE else 0.0

    def prompt_experts(self, streamed: int) -> int:
        """Of a few-row prompt pass's `streamed` experts a layer, how many the host computes so that it
        finishes with the link: (S - n) b / link = overhead + n b / host (each expert read once, its
        few rows riding along); 0 where fewer than AUTO_MIN_SHARE of them."""
        per_link, per_host = self.expert_bytes / self.link_bytes_per_s, self.expert_bytes / self.host.bytes_per_s
        n = int((streamed * per_link - self.host.overhead_s) / (per_link + per_host))
        return n if n >= AUTO_MIN_SHARE * streamed else 0


class ShareTrial:
    """`auto`'s share checked by the clock rather than by its model: decode steps run in blocks,
    alternately at the share and at 0 (the host given nothing), each step timed from its `arm` to
    the next; once TRIAL_BLOCKS of each have run, the share stays only where the median step with
    the host is shorter by more than TRIAL_MARGIN, else the trial answers 0 (`auto` declines).

    `step(now)` is called at each arm with the time (perf_counter seconds) and answers the share
    the step about to be queued runs at, or None once the trial has decided (`verdict`)."""

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
        """Blocks alternate, the first without the host; the steps queued while the last ones'
        times are awaited run with it."""
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


def host_sums(executor: CpuExperts, arena: HostExpertArena, layer: int, h: torch.Tensor, picks: np.ndarray,
              weights: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """The host's part of a pass: picks [T, A] (an expert id where the host computes it, -1
    elsewhere), weights [T, A], rows h [T, D] -> (the sums of the rows that have host picks [R, D]
    fp32, those rows' indices [R]). A row's picks are padded to the widest row's count with its own
    first pick at weight 0 (ggml computes [R, A'] picks; a repeated expert's bytes are read once)."""
    if picks.shape[0] == 1:  # a decode step's one row: no padding, no row selection (host time a layer)
        sel = np.flatnonzero(picks[0] >= 0)
        ids1, w1 = picks[:, sel], weights[:, sel]
        return executor.moe(arena.layer(layer), arena.layouts[layer], h, torch.from_numpy(w1),
                            torch.from_numpy(ids1)), ONE_ROW
    mine = picks >= 0
    counts = mine.sum(axis=1)
    rows = np.flatnonzero(counts)
    width = int(counts.max())
    # each row's own picks first (a stable sort on "not mine"), then its first pick again at weight 0
    order = np.argsort(~mine[rows], axis=1, kind="stable")[:, :width]
    ids = np.take_along_axis(picks[rows], order, axis=1).astype(np.int32)
    w = np.take_along_axis(weights[rows], order, axis=1).astype(np.float32)
    pad = np.arange(width)[None, :] >= counts[rows][:, None]
    ids = np.where(pad, ids[:, :1], ids).astype(np.int32)
    w = np.where(pad, np.float32(0), w).astype(np.float32)
    x = h[torch.from_numpy(rows)] if len(rows) < h.shape[0] else h
    out = executor.moe(arena.layer(layer), arena.layouts[layer], x, torch.from_numpy(w), torch.from_numpy(ids))
    return out, rows


ONE_ROW = np.zeros(1, dtype=np.int64)  # host_sums' rows where the pass has one


def probe_host_rate(executor: CpuExperts, arena: HostExpertArena, layer: int, n_used: int, d: int,
                    repeats: int = PROBE_REPEATS) -> HostRate:
    """The host's cost of a request on `layer` at one row: timed with 1 pick and with `n_used` (the
    median of `repeats` calls each, fresh experts every call, as in decode: nothing in the caches,
    after calls that build the graphs), a line through the two, plus the mailbox's round trip."""
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


class Mailbox:
    """Mapped host memory a stage's GPU and its worker exchange a layer's rows through (pinned on
    CUDA): the request and done numbers (int64, a cache line apart), the status word, the rows, picks,
    weights and meta the GPU writes, and the sums [T, D] the host writes back."""

    def __init__(self, max_rows: int, n_used: int, hidden: int, *, pin: bool):
        self.max_rows = max_rows
        self.flags = host_buffer(256, pin=pin).view(torch.int64)  # [32]: request at 0, done at 8, status at 16
        self.h = host_buffer(4 * max_rows * hidden, pin=pin).view(torch.float32)
        self.picks = host_buffer(4 * max_rows * n_used, pin=pin).view(torch.int32)
        self.weights = host_buffer(4 * max_rows * n_used, pin=pin).view(torch.float32)
        self.meta = host_buffer(16, pin=pin).view(torch.int32)  # T, A, local layer, host picks
        self.out = host_buffer(4 * max_rows * hidden, pin=pin).view(torch.float32)
        # the share of misses the host takes: handover_send reads it each launch, the host writes it
        # (`set_share`, and 0 where the worker failed), no kernel needed, so a graph replays the latest
        self.share = host_buffer(16, pin=pin).view(torch.float32)
        self.share_np = self.share.numpy()
        self.flags_np = self.flags.numpy()
        # numpy views made once: the worker reads them every request
        self.meta_np, self.picks_np, self.weights_np = self.meta.numpy(), self.picks.numpy(), self.weights.numpy()
        self.hidden = hidden

    # what the kernels take: host addresses, which the device reads and writes through the mapping
    @property
    def request_at(self) -> int:
        return self.flags.data_ptr()

    @property
    def done_at(self) -> int:
        return self.flags.data_ptr() + 8 * 8

    @property
    def status_at(self) -> int:
        return self.flags.data_ptr() + 16 * 8

    @property
    def request(self) -> int:
        return int(self.flags_np[0])

    @property
    def done(self) -> int:
        return int(self.flags_np[8])

    @done.setter
    def done(self, value: int) -> None:
        self.flags_np[8] = value  # one aligned 8-byte store, after the sums' (x86 keeps stores in order)

    @property
    def status(self) -> int:
        return int(self.flags_np[16])


class HandoverWorker:
    """The host's side (module docstring, step 3): a thread serving the mailbox's requests while armed.
    `rates` counts what each request read and took, polling excluded (rows -> ExpertRate)."""

    def __init__(self, mailbox: Mailbox, executor: CpuExperts, arena: HostExpertArena, layers: range):
        self.mailbox, self.executor, self.arena, self.layers = mailbox, executor, arena, layers
        self.counter = RateCounter()
        self.samples: deque[tuple[int, float]] = deque(maxlen=RETUNE_SAMPLES)  # (bytes, seconds) a request
        self.error: BaseException | None = None
        self._armed_until = 0.0
        self._wake = threading.Event()
        self._stop = False
        self._task: tuple[Callable[[], object], Future] | None = None  # `call`'s, run between requests
        self._thread = threading.Thread(target=self._serve, name="strata cpu experts", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() run on the worker's own thread (its result or its exception): what the worker will
        measure, such as `probe_host_rate`, measured on the thread that computes the requests (ggml's
        pool serves its caller as its first thread)."""
        done: Future = Future()
        self._task = (fn, done)
        self._wake.set()
        return done.result()

    def arm(self) -> None:
        """A step that may ask is about to be queued: poll from now until IDLE_SPIN_S after it."""
        self._armed_until = time.monotonic() + IDLE_SPIN_S
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        box = self.mailbox
        last = box.request
        while not self._stop:
            if self._task is not None:
                fn, done = self._task
                self._task = None
                try:
                    done.set_result(fn())
                except BaseException as e:
                    done.set_exception(e)
                continue
            request = box.request
            if request == last:
                if time.monotonic() > self._armed_until:  # idle: a wake from arm(), or the next check
                    self._wake.wait(IDLE_POLL_S)
                    self._wake.clear()
                else:
                    time.sleep(0)  # lets the engine's thread have the GIL between polls
                continue
            last = request
            t0 = time.perf_counter()
            try:
                rows, nbytes = self._answer()
            except BaseException as e:  # later layers give the host nothing; the next arm() detaches
                log.exception("the host's cores failed a hand-over")
                self.error = e
                box.share_np[0] = 0.0
                box.out.zero_()
                rows, nbytes = 0, 0
            self._armed_until = time.monotonic() + IDLE_SPIN_S
            box.done = request
            seconds = time.perf_counter() - t0
            self.counter.count(rows, nbytes, seconds)
            if nbytes:
                self.samples.append((nbytes, seconds))

    def _answer(self) -> tuple[int, int]:
        box = self.mailbox
        meta = box.meta_np
        t, a, i = int(meta[0]), int(meta[1]), int(meta[2])
        picks = box.picks_np[:t * a].reshape(t, a)
        weights = box.weights_np[:t * a].reshape(t, a)
        h = box.h[:t * box.hidden].view(t, box.hidden)
        out = box.out[:t * box.hidden].view(t, box.hidden)
        layer = self.layers[i]
        if not 0 < t <= box.max_rows or not (picks >= 0).any():  # not a request as handover_send writes them
            raise RuntimeError(f"a hand-over request of {t} rows with no host picks: the mailbox was overwritten")
        sums, rows = host_sums(self.executor, self.arena, layer, h, picks, weights)
        if len(rows) < t:
            out.zero_()
            out[torch.from_numpy(rows)] = sums
        else:
            out.copy_(sums)
        mine = picks[picks >= 0]
        n_experts = len(mine) if t == 1 else len(np.unique(mine))  # a row's picks are distinct
        return t, n_experts * self.arena.layouts[layer].expert_bytes


class CpuHandover:
    """A CUDA stage's hand-over (module docstring): the device's share and carry, the mailbox, the
    worker. `send` before the GPU's fused kernels, `add` after them, `arm` before each step."""

    def __init__(self, ctx: DeviceContext, arena: HostExpertArena, cache: ExpertCache, executor: CpuExperts,
                 layers: range, share: float, max_rows: int = MAX_ROWS, auto: AutoShare | None = None):
        spec = arena.spec
        assert spec.n_experts <= MAX_EXPERTS and 0 <= share <= 1
        self.ctx, self.cache, self.executor, self.max_rows, self.auto = ctx, cache, executor, max_rows, auto
        self.arena, self.layers = arena, layers
        self._steps = 0  # arms: decode steps
        self._trial: ShareTrial | None = None  # `auto`'s check by the clock, while it runs
        device = ctx.device
        self.carry = torch.zeros(1, dtype=torch.float32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.n_host = torch.zeros(1, dtype=torch.int32, device=device)
        self.mailbox = Mailbox(max_rows, spec.n_experts_used, spec.hidden, pin=True)
        self.mailbox.share_np[0] = share
        self.worker = HandoverWorker(self.mailbox, executor, arena, layers)
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._fn = {name: nvrtc.kernel(HANDOVER_FILE, name, (), device) for name in KERNELS}
        self.share_value = share

    def describe(self) -> str:
        how = "auto" if self.auto is not None else "fixed"
        return f"{self.share_value:.2f} ({how}) of the missing experts to the host's cores ({self.executor.describe()})"

    def takes(self, rows: int) -> bool:
        return rows <= self.max_rows

    def silent_faults(self) -> int:
        """Failures the GPU's layers went on past (both stay set until the hand-over is closed): a
        host that did not answer in time (the status word; later waits then skip the host's part)
        and a worker that failed (it answered zeros)."""
        return int(self.mailbox.status != 0) + int(self.worker.error is not None)

    def set_share(self, share: float) -> None:
        """A new share for the layers not yet sent (written into the mailbox: graphs read it there)."""
        assert 0 <= share <= 1
        self.mailbox.share_np[0] = share
        self.share_value = share

    def calibrate(self, link_bytes_per_s: float) -> float:
        """`auto`: the host's rate probed on the worker's thread, against the link's; the share at
        the uniform hit rate set (the cache's own tallies `retune` it later) and returned."""
        spec, first = self.arena.spec, self.layers.start
        host = self.worker.call(lambda: probe_host_rate(self.executor, self.arena, first, spec.n_experts_used,
                                                        spec.hidden))
        self.auto = AutoShare(host, link_bytes_per_s, self.arena.layouts[first].expert_bytes, spec.n_experts_used)
        self.set_share(self.auto.share(self.cache.hit_rate_uniform))
        return self.share_value

    def retune(self) -> None:
        """`auto`: the share again, at the hit rate the expert cache has seen (its tallies, kept at
        each refill) and at the host's rate its answered requests show (`HostRate.refit`); a fixed
        share stays. A share that falls to 0 stays there: no request comes to measure again."""
        if self.auto is None:
            return
        vram, picks = self.cache.vram_picks, self.cache.all_picks
        hit = vram / picks if picks > 0 else self.cache.hit_rate_uniform
        samples = list(self.worker.samples)
        if len(samples) >= 32:
            self.auto = replace(self.auto, host=self.auto.host.refit(samples))
        share = self.auto.share(hit)
        if abs(share - self.share_value) > 0.02:
            log.info("--cpu-experts auto: %.2f of the missing experts on the host's cores (a hit rate of %.2f; "
                     "the host %.1f GB/s after %.0f us a request)", share, hit, self.auto.host.bytes_per_s / 1e9,
                     1e6 * self.auto.host.overhead_s)
            self.set_share(share)

    def wake(self) -> None:
        """Before a pass that may hand over (a gathered or few-row prompt pass, eager): the worker
        polls while it runs. `arm` does this for a decode step and more."""
        self.worker.arm()

    def arm(self) -> bool:
        """Before a decode step (eager or replayed): wake the worker; every RETUNE_STEPS, `auto` retunes.
        False where the hand-over should go: the worker failed, the host did not answer in time
        (both said in the log), or `auto` declined (its share fell to 0). The stage then detaches it
        (`StreamedExperts.arm`) and its graphs are captured again without it. Inside a graph
        capture it only wakes the worker: nothing else may be recorded there."""
        self.worker.arm()
        if torch.cuda.is_current_stream_capturing():
            return True
        if self.worker.error is not None:
            log.error("the host's cores failed an expert hand-over (%s): decode goes on over the link alone",
                      self.worker.error)
            return False
        if self.mailbox.status != 0:
            log.error("the host's cores did not answer an expert hand-over within %.0f s: decode goes on over the "
                      "link alone", TIMEOUT_S)
            return False
        self._steps += 1
        if self.auto is not None:
            self._tune(time.perf_counter())
        return self.auto is None or self.share_value > 0

    def _tune(self, now: float) -> None:
        """`auto` at a decode step's arm: every RETUNE_STEPS its model again (`retune`); after the
        first retune and every TRIAL_EVERY_STEPS after, the share tried by the clock (`ShareTrial`),
        whose verdict stands (0: declined, detached at this arm). The step about to be queued runs
        at the share left in the mailbox."""
        if self._trial is not None:
            share = self._trial.step(now)
            if share is not None:
                self.mailbox.share_np[0] = share
                return
            trial, self._trial = self._trial, None
            with_host, without = trial.medians
            log.info("--cpu-experts auto: decode steps took %.2f ms with %.2f of the missing experts on the host's "
                     "cores, %.2f ms without: %s", 1e3 * with_host, trial.share, 1e3 * without,
                     "kept" if trial.verdict else "the link alone from now on")
            self.set_share(trial.verdict or 0.0)
            return
        if self._steps % RETUNE_STEPS == 0:
            self.retune()
            if self.share_value > 0 and self._steps % TRIAL_EVERY_STEPS == RETUNE_STEPS:
                self._trial = ShareTrial(self.share_value)
                self._tune(now)  # the trial's first step

    def send(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Local layer i's picks experts [T, A] split: the host's go to the mailbox; returns the GPU's
        [T, A] (the host's -1)."""
        t, a = experts.shape
        box = self.mailbox
        h, weights, experts = h.contiguous(), weights.float().contiguous(), experts.contiguous()
        gpu = torch.empty_like(experts)
        slot_of = self.cache.slot_of[i]  # [E] on the device
        nvrtc.launch(self._fn["handover_send"], 1, SEND_THREADS,
                     (experts.data_ptr(), weights.data_ptr(), h.data_ptr(), slot_of.data_ptr(), np.int32(t),
                      np.int32(a), np.int32(h.shape[1]), np.int32(slot_of.shape[0]), np.int32(i),
                      self.mailbox.share.data_ptr(), self.carry.data_ptr(), self.counter.data_ptr(),
                      self.n_host.data_ptr(),
                      gpu.data_ptr(), box.h.data_ptr(), box.picks.data_ptr(), box.weights.data_ptr(),
                      box.meta.data_ptr(), box.request_at), self.ctx.device)
        return gpu

    def send_prompt(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    host_of: torch.Tensor) -> None:
        """A prompt pass's rows of local layer i: the picks of the experts host_of [E] (uint8 on the
        device) marks go to the host (the rows by handover_rows' many blocks first)."""
        t, a = experts.shape
        box = self.mailbox
        h, weights, experts = h.contiguous(), weights.float().contiguous(), experts.contiguous()
        nvrtc.launch(self._fn["handover_rows"], min(ROWS_BLOCKS, -(-h.numel() // ADD_THREADS)), ADD_THREADS,
                     (h.data_ptr(), box.h.data_ptr(), np.int64(h.numel())), self.ctx.device)
        nvrtc.launch(self._fn["handover_send_fixed"], 1, SEND_THREADS,
                     (experts.data_ptr(), weights.data_ptr(), host_of.data_ptr(), np.int32(t), np.int32(a),
                      np.int32(i), self.counter.data_ptr(), self.n_host.data_ptr(), box.picks.data_ptr(),
                      box.weights.data_ptr(), box.meta.data_ptr(), box.request_at), self.ctx.device)

    def collect(self, rows: int, hidden: int) -> torch.Tensor:
        """The host's sums [rows, D] bf16 of the last `send_prompt`, once it answered (zeros where it
        had no picks)."""
        return self.add(torch.zeros(rows, hidden, dtype=torch.bfloat16, device=self.ctx.device))

    def add(self, out: torch.Tensor) -> torch.Tensor:
        """The GPU's sums out [T, D] bf16 plus the host's, once the host answered (in place)."""
        assert out.dtype == torch.bfloat16 and out.is_contiguous()
        n = out.numel()
        blocks = min(ADD_BLOCKS, -(-n // ADD_THREADS))
        nvrtc.launch(self._fn["handover_add"], blocks, ADD_THREADS,
                     (out.data_ptr(), self.mailbox.out.data_ptr(), self.mailbox.done_at,
                      self.counter.data_ptr(), self.n_host.data_ptr(), self.mailbox.status_at,
                      np.int64(int(TIMEOUT_S * 1e9)), np.int64(n)), self.ctx.device)
        return out

    def close(self) -> None:
        """Stop the worker and free its pool. The caller has waited for every step that used it
        (`StreamedExperts.arm`): a kernel still in flight would write into freed pinned memory."""
        self.set_share(0.0)
        self.worker.close()
        self.executor.close()


class HandoverTwin:
    """The hand-over's arithmetic on a CPU stage's device-path twins (tests): the picks chosen as
    handover_send chooses them (`assign_host`), the host's sums computed at `send` and added at
    `add` in fp32."""

    def __init__(self, arena: HostExpertArena, cache: ExpertCache, executor: CpuExperts, layers: range,
                 share: float, max_rows: int = MAX_ROWS):
        self.arena, self.cache, self.executor, self.layers, self.max_rows = arena, cache, executor, layers, max_rows
        self.share_value, self.carry = share, 0.0
        self.auto: AutoShare | None = None  # a fixed share only
        self._pending: torch.Tensor | None = None
        self.host_picks = 0  # picks the host computed, over every call (tests read it)

    def describe(self) -> str:
        return f"{self.share_value:.2f} of the missing experts on the host's cores (twin, {self.executor.describe()})"

    def takes(self, rows: int) -> bool:
        return rows <= self.max_rows

    def silent_faults(self) -> int:
        return 0  # the host's sums are computed in the call: a failure raises

    def set_share(self, share: float) -> None:
        self.share_value = share

    def wake(self) -> None:
        pass

    def arm(self) -> bool:
        return True

    def send(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        resident = (self.cache.slot_of_host[i] >= 0).numpy()
        host, self.carry = assign_host(experts.reshape(-1).tolist(), resident, self.share_value, self.carry)
        is_host = torch.isin(experts, torch.tensor(sorted(host), dtype=experts.dtype))
        self._pending = None
        if host:
            picks = torch.where(is_host, experts, -1).numpy().astype(np.int32)
            sums, rows = host_sums(self.executor, self.arena, self.layers[i], h.float(), picks, weights.float().numpy())
            self._pending = torch.zeros(h.shape, dtype=torch.float32)
            self._pending[torch.from_numpy(rows)] = sums
            self.host_picks += int(is_host.sum())
        return torch.where(is_host, -1, experts)

    def add(self, out: torch.Tensor) -> torch.Tensor:
        if self._pending is None:
            return out
        return (out.float() + self._pending.to(out.device)).to(out.dtype)

    def send_prompt(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    host_of: torch.Tensor) -> None:
        is_host = host_of[experts].bool()
        self._pending = torch.zeros(h.shape, dtype=torch.float32)
        if bool(is_host.any()):
            picks = torch.where(is_host, experts, -1).numpy().astype(np.int32)
            sums, rows = host_sums(self.executor, self.arena, self.layers[i], h.float(), picks, weights.float().numpy())
            self._pending[torch.from_numpy(rows)] = sums
            self.host_picks += int(is_host.sum())

    def collect(self, rows: int, hidden: int) -> torch.Tensor:
        assert self._pending is not None and self._pending.shape == (rows, hidden)
        out, self._pending = self._pending, None
        return out

    def close(self) -> None:
        pass


class HostPrefillHelper:
    """A streamed prompt pass of few rows (at most the mailbox's) gives the last `n_experts` streamed
    experts of each layer to the host's cores: the `PrefillHelper` contract, as the split's PeerPrefill,
    with the hand-over's mailbox and worker as the other device. The link streams fewer experts; the
    host reads its ones once from the pinned arena, their few rows riding along. `takes` sets the
    pass's share (the fixed `--cpu-experts F` of the streamed experts, or `AutoShare.prompt_experts`);
    each layer's rows go over at `hand_over`, and the GPU waits for the host's sums at `collect`,
    after it queued its own part of the layer."""

    halves_from = 0  # one hand-over a layer

    def __init__(self, handover: CpuHandover | HandoverTwin):
        self.handover = handover
        self.n_experts = 0  # this pass's share of each layer's streamed experts (`takes`)
        self._host_of: torch.Tensor | None = None  # [L, E] uint8: the host's experts of each local layer
        self._rows: list[int] = []  # hand-overs not yet collected: their rows

    @property
    def bound(self) -> bool:
        return self.n_experts > 0

    def takes(self, n_rows: int, streamed: int) -> bool:
        """Does a streamed pass of n_rows (`streamed` experts a layer) give the host a share? Sets it."""
        handover = self.handover
        if n_rows > handover.max_rows or streamed <= 0:
            self.n_experts = 0
        elif handover.auto is not None:
            self.n_experts = min(streamed, handover.auto.prompt_experts(streamed))
        else:
            self.n_experts = min(streamed, round(handover.share_value * streamed))
        return self.n_experts > 0

    def begin(self, parts: list[LayerPart]) -> None:
        """The host's part of each local layer (the streamed experts split_layer gave it)."""
        n_experts = self.handover.arena.spec.n_experts
        host_of = torch.zeros(len(parts), n_experts, dtype=torch.uint8)
        for i, part in enumerate(parts):
            host_of[i, list(part.streamed)] = 1
        device = self.handover.cache.slot_of.device
        pinned = host_of if device.type == "cpu" else host_of.pin_memory()  # no host wait for the copy
        self._host_of = pinned.to(device, non_blocking=True)
        self._rows = []
        self.handover.wake()

    def hand_over(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  first: bool = True) -> None:
        assert self._host_of is not None, "begin() first"
        self.handover.send_prompt(i, h, weights, experts, self._host_of[i])
        self._rows.append(h.shape[0])

    def collect(self) -> torch.Tensor:
        rows = self._rows.pop(0)
        return self.handover.collect(rows, self.handover.arena.spec.hidden)

    def abort(self) -> None:
        """Nothing is held but the pending hand-overs' sums: dropped (a host still computing answers
        into the mailbox, which the next request overwrites)."""
        self._rows = []
        self._host_of = None

