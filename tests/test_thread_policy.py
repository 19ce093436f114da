"""A CPU stage's threads under other processes' load: the policy (kernels/thread_policy.py) on
simulated hosts, the run-queue reader (kernels/run_queue.py) on this Linux, the pace between them
on a fake clock."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch

from strata_mgpu.kernels import run_queue
from strata_mgpu.kernels.run_queue import RunQueueDelta, RunQueueWait, ThreadPace
from strata_mgpu.kernels.thread_policy import (
    BASE_HOLD_S,
    BASELINE_WINDOWS,
    MAX_HOLD_S,
    PROBE_WINDOWS,
    ThreadPolicy,
    Window,
    slowdown,
)

W = 0.1  # a window's wall seconds
DECODE = (0, 1000, 1)  # one kind of call: a decode step's experts of a layer


def quiet(k: int) -> float:
    return 1e-3 / k  # a call's seconds on k threads: every thread helps


def shared(best: int) -> Callable[[int], float]:
    """Other processes leave `best` cores: beyond, a thread that loses its core stalls the rest."""
    return lambda k: 1e-3 / min(k, best) * (1 if k <= best else 5 * (k - best))


def simulate(policy: ThreadPolicy, seconds: float, cost: Callable[[int], float], waiting: float | None = 0.02,
             noise: float = 0.0) -> list[int]:
    """Windows of calls at the policy's count, each call `cost(k)` (times a deterministic wobble of
    +-noise) -> the count of each window."""
    seen = []
    for i in range(round(seconds / W)):
        k = policy.threads
        seen.append(k)
        c = cost(k) * (1 + noise * ((i * 7919) % 13 - 6) / 6)
        n = max(1, round(W / c))
        policy.observe(Window(W, {DECODE: (n, n * c)}, waiting))
    return seen


def test_a_quiet_host_keeps_every_thread_and_probes_ever_more_rarely():
    policy = ThreadPolicy(8)
    seen = simulate(policy, 300, quiet, noise=0.05)
    assert seen.count(8) / len(seen) > 0.98 and min(seen) == 7  # the probes, one thread down
    assert policy.settled == 8 and policy.hold_s[-1] == MAX_HOLD_S
    probes = [i for i in range(1, len(seen)) if seen[i] == 7 and seen[i - 1] == 8]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= MAX_HOLD_S / W


def test_a_shared_host_settles_where_the_calls_are_fastest():
    for best in (1, 3, 5):
        policy = ThreadPolicy(6)
        seen = simulate(policy, 120, shared(best), noise=0.05)
        assert policy.settled == best, best
        assert seen[-600:].count(best) / 600 > 0.95, best  # the last minute


def test_a_new_load_is_probed_at_once_and_a_gone_one_climbed_back():
    policy = ThreadPolicy(8)
    simulate(policy, 120, quiet, waiting=0.02)
    assert policy.settled == 8 and policy.hold_s[-1] == MAX_HOLD_S
    # others take five cores: the wait rises, so the next probe down comes now, not MAX_HOLD_S on
    seen = simulate(policy, 10, shared(3), waiting=1.5)
    assert seen.index(7) <= (BASELINE_WINDOWS + 1) and policy.settled == 3
    seen = simulate(policy, 30, quiet, waiting=0.02)
    assert policy.settled == 8 and seen.index(8) * W < 8 * (BASE_HOLD_S + 1)


def test_without_the_run_queue_a_new_load_waits_for_the_next_probe():
    policy = ThreadPolicy(4)
    simulate(policy, 120, quiet, waiting=None)
    assert policy.settled == 4
    seen = simulate(policy, 2 * MAX_HOLD_S + 2, shared(2), waiting=None)
    assert seen[:round(2 / W)].count(4) == round(2 / W) and policy.settled == 2


def test_only_like_calls_are_compared():
    prompt, decode = (0, 1000, 256), DECODE
    assert slowdown({decode: (10, 1.0)}, {decode: (20, 4.0)}) == pytest.approx(0.5)
    assert slowdown({prompt: (1, 0.5), decode: (2, 0.2)}, {decode: (1, 0.2)}) == pytest.approx(0.5)
    assert slowdown({prompt: (1, 0.5)}, {decode: (1, 0.1)}) is None
    # a probe that saw only a prompt's calls, the baseline only decode's: neither a move nor a longer hold
    policy = ThreadPolicy(4)
    for _ in range(round(BASE_HOLD_S / W) + 1):
        policy.observe(Window(W, {decode: (100, 0.1)}))
    assert policy.threads == 3  # the probe
    for _ in range(PROBE_WINDOWS):
        policy.observe(Window(W, {prompt: (1, 0.01)}))
    assert policy.threads == policy.settled == 4 and policy.hold_s[-1] == BASE_HOLD_S


def test_a_window_must_say_its_wall_time():
    with pytest.raises(AssertionError):
        ThreadPolicy(2).observe(Window(-1.0))
    with pytest.raises(AssertionError):
        ThreadPolicy(0)


def spinner(cpu: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])


@pytest.mark.skipif(not RunQueueWait().available, reason="no /proc/self/task/*/schedstat here")
def test_the_reader_sees_a_process_wait_behind_another_on_its_core():
    cpu = min(run_queue.os.sched_getaffinity(0))
    measured, other = spinner(cpu), None
    try:
        reader = RunQueueWait(f"/proc/{measured.pid}/task")
        time.sleep(0.3)
        reader.delta()
        time.sleep(0.3)
        alone = reader.delta()
        other = spinner(cpu)
        time.sleep(0.2)
        reader.delta()
        time.sleep(0.5)
        shared = reader.delta()
    finally:
        for p in (measured, other):
            if p is not None:
                p.kill()
                p.wait()
    assert alone is not None and shared is not None
    # sharing one core with another spinner, it waits about half the time (others' load here adds to both)
    assert shared.wait_s > 0.15 and shared.wait_s > alone.wait_s + 0.1, (alone, shared)
    assert shared.slices > 0
    # our own process reads too; a directory that is not there gives no signal
    assert RunQueueWait().delta() is not None
    gone = RunQueueWait("/nonexistent/task")
    assert not gone.available and gone.delta() is None


class FakeReader(RunQueueWait):
    def __init__(self, deltas: list[RunQueueDelta]):
        self.deltas, self.reads, self.available = deltas, 0, True

    def delta(self) -> RunQueueDelta | None:
        self.reads += 1
        return self.deltas.pop(0) if self.deltas else RunQueueDelta(0.0, 0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def calls(pace: ThreadPace, clock: FakeClock, seconds: float, cost: Callable[[int], float]) -> None:
    """Calls back to back for `seconds` of the fake clock, each `cost(k)` on the pace's k."""
    end = clock.t + seconds
    while clock.t < end:
        k = pace.threads_now()
        clock.t += cost(k)
        pace.call_done(DECODE, cost(k))


def test_the_pace_gives_the_policy_windows_and_skips_idle_time():
    reader, clock = FakeReader([]), FakeClock()
    pace = ThreadPace(4, reader=reader, clock=clock)
    assert pace.adaptive and pace.threads_now() == 4
    calls(pace, clock, 1.0, quiet)
    windows = 1.0 / run_queue.SAMPLE_S
    assert windows - 1 <= reader.reads <= windows + 1  # one read a window, not a call
    calls(pace, clock, 60, shared(2))
    assert pace.policy.settled == 2 and pace.threads in (1, 2, 3)
    reads, baseline = reader.reads, list(pace.policy._baseline)
    clock.t += 10 * run_queue.IDLE_S  # idle: the next call starts a window rather than judging this one
    pace.threads_now()
    assert reader.reads == reads + 1 and pace.policy._baseline == baseline


def test_the_pace_keeps_the_ceiling_when_not_adaptive_and_torch_threads_follow():
    before = torch.get_num_threads()
    for pace in (ThreadPace(3, adaptive=False), ThreadPace(1)):
        assert not pace.adaptive and pace.threads_now() == pace.policy.ceiling
    assert ThreadPace(3, reader=RunQueueWait("/nonexistent/task")).adaptive  # the calls' times alone
    try:
        clock = FakeClock()
        pace = ThreadPace(3, torch_threads=True, reader=FakeReader([]), clock=clock)
        assert torch.get_num_threads() == 3
        calls(pace, clock, 30, shared(2))
        assert pace.policy.settled == 2 and torch.get_num_threads() == pace.threads
        pace.close()
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
