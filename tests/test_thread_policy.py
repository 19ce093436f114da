"""A CPU stage's threads under other processes' load: the policy (kernels/thread_policy.py) on
synthetic windows, the run-queue reader (kernels/run_queue.py) on this Linux, the pace between
them on a fake clock."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from strata_mgpu.kernels import run_queue
from strata_mgpu.kernels.run_queue import RunQueueDelta, RunQueueWait, ThreadPace
from strata_mgpu.kernels.thread_policy import BASE_HOLD_S, HOT_WINDOWS, MAX_HOLD_S, ThreadPolicy

W = 0.1  # a window's wall seconds
QUIET = (W, 0.0, 50)
WAKE_UPS = (W, 0.08, 8000)  # many short waits (10 us each): a quiet host's wake-ups, however many
BLIP = (W, 0.004, 2)  # two 2 ms waits in the window: below LOAD_HIGH


def contended(waiting: float) -> tuple[float, float, int]:
    """A window in which `waiting` of our threads wait for a core on average, 3 ms a slice."""
    return W, waiting * W, max(1, round(waiting * W / 3e-3))


def run(policy: ThreadPolicy, windows: list[tuple[float, float, int]]) -> list[int]:
    return [policy.observe(*w) for w in windows]


def test_a_quiet_host_keeps_every_thread():
    for windows in ([QUIET] * 200, [WAKE_UPS] * 200, [BLIP] * 200):
        assert set(run(ThreadPolicy(8), windows)) == {8}


def test_contention_takes_threads_away_by_the_cores_taken_never_below_one():
    policy = ThreadPolicy(8)
    assert run(policy, [contended(2.0)] * HOT_WINDOWS) == [8] * (HOT_WINDOWS - 1) + [6]  # two cores taken: two
    assert run(ThreadPolicy(8), [contended(7.0)] * HOT_WINDOWS)[-1] == 4  # at most half at once
    assert run(ThreadPolicy(8), [contended(0.3)] * HOT_WINDOWS)[-1] == 7  # at least one
    # one contended window alone (another process's burst) changes nothing
    assert set(run(ThreadPolicy(8), [contended(2.0), QUIET] * 50)) == {8}
    # sustained: down to one and held there, however long, with no probe while it stays contended
    assert run(ThreadPolicy(8), [contended(1.0)] * 400)[-300:] == [1] * 300


def test_a_host_gone_quiet_is_climbed_back_one_thread_a_hold():
    policy = ThreadPolicy(4)
    run(policy, [contended(4.0)] * 20)
    assert policy.threads == 1
    per_hold = round(BASE_HOLD_S / W)
    got = run(policy, [QUIET] * (4 * per_hold))
    assert got[per_hold - 1] == 2 and got[2 * per_hold - 1] == 3 and got[3 * per_hold - 1] == 4 and got[-1] == 4


def test_a_steady_competitor_costs_a_probe_ever_more_rarely():
    """Three threads fit beside the other load, four do not: the policy settles at three; each
    probe to four is taken back at its first window and the next comes twice as late, to
    MAX_HOLD_S; a probe that holds (the load gone) resets the wait."""
    policy = ThreadPolicy(6)
    seen = []
    for _ in range(3000):  # 300 s
        k = policy.threads
        seen.append(k)
        policy.observe(*(contended(1.0) if k >= 4 else QUIET))
    settled = seen[200:]
    assert set(settled) == {3, 4}
    probes = [i for i in range(1, len(settled)) if settled[i] == 4 and settled[i - 1] == 3]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps and max(gaps) <= round(MAX_HOLD_S / W) + 2 and gaps[-1] >= round(MAX_HOLD_S / W)
    assert settled.count(4) / len(settled) < 0.01
    assert policy.hold_s == MAX_HOLD_S
    run(policy, [QUIET] * 400)
    assert policy.threads == 6 and policy.hold_s == BASE_HOLD_S


def test_a_window_must_say_its_wall_time():
    assert not ThreadPolicy.contended(0.0, 0.0, 0)
    with pytest.raises(AssertionError):
        ThreadPolicy(2).observe(-1.0, 0.0, 0)
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


def test_the_pace_samples_once_a_window_and_skips_idle_time():
    busy = RunQueueDelta(2.0 * run_queue.SAMPLE_S, 100)  # two threads waiting, 2 ms a slice
    reader, clock = FakeReader([busy] * 20), FakeClock()
    pace = ThreadPace(4, reader=reader, clock=clock)
    assert pace.adaptive and pace.threads_now() == 4
    for _ in range(1000):  # a second of calls a millisecond apart: one read a window
        clock.t += 0.001
        pace.threads_now()
        pace.call_done()
    windows = 1.0 / run_queue.SAMPLE_S
    assert windows - 1 <= reader.reads <= windows + 1
    assert pace.threads == 1  # the busy windows took two threads, then the last but one
    reads = reader.reads
    clock.t += 10 * run_queue.IDLE_S  # idle: the next call starts a window rather than judging this one
    assert pace.threads_now() == 1 and reader.reads == reads + 1 and pace.policy._quiet_s == 0


def test_the_pace_keeps_the_ceiling_without_a_signal_and_torch_threads_follow():
    before = torch.get_num_threads()
    for pace in (ThreadPace(3, adaptive=False), ThreadPace(3, reader=RunQueueWait("/nonexistent/task")),
                 ThreadPace(1)):
        assert not pace.adaptive and pace.threads_now() == pace.policy.ceiling
    try:
        reader, clock = FakeReader([RunQueueDelta(0.3, 100)] * 4), FakeClock()
        pace = ThreadPace(3, torch_threads=True, reader=reader, clock=clock)
        assert torch.get_num_threads() == 3
        for _ in range(HOT_WINDOWS):
            clock.t += run_queue.SAMPLE_S
            pace.threads_now()
            pace.call_done()
        assert pace.threads == 2 == torch.get_num_threads()
        pace.close()
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
