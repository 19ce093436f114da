"""The mechanism beside `thread_policy`: the process's run-queue wait read from the kernel, and the
pace that feeds it to the policy from a CPU stage's executor calls.

/proc/self/task/TID/schedstat holds three numbers a thread (Linux, schedstats on: the default of
every distribution kernel): nanoseconds on a core, nanoseconds runnable on a run queue waiting for
one, and the slices it ran. Where the files cannot be read (not Linux, a restricted /proc) there is
no signal, and the pace keeps the configured threads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata_mgpu.kernels.thread_policy import ThreadPolicy

log = logging.getLogger("strata.kernels")
TASKS = "/proc/self/task"
SAMPLE_S = 0.1  # a window: reading every thread's file costs tens of microseconds, so not every call
# a gap this long from one call's end to the next call starts a new window: an idle executor's wall time
# says nothing (longer than the torch ops between a collapsed decode's layers, shorter than idle between requests)
IDLE_S = 0.25


@dataclass(frozen=True)
class RunQueueDelta:
    wait_s: float  # run-queue wait since the previous read, summed over the process's threads
    slices: int  # slices run since the previous read, likewise


class RunQueueWait:
    """The process's threads' run-queue wait between one read and the next, by thread id (a thread
    that ended drops out; one that started counts from its start)."""

    def __init__(self, tasks: str = TASKS):
        self.tasks = tasks
        self._last = self._read()
        self.available = self._last is not None

    def _read(self) -> dict[str, tuple[int, int]] | None:
        try:
            names = os.listdir(self.tasks)
        except OSError:
            return None
        seen = {}
        for name in names:
            try:
                with open(f"{self.tasks}/{name}/schedstat", "rb") as fh:
                    fields = fh.read().split()
                seen[name] = (int(fields[1]), int(fields[2]))
            except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
                continue
        return seen or None

    def delta(self) -> RunQueueDelta | None:
        """Since the previous read (None: the files could not be read)."""
        now = self._read()
        if now is None:
            return None
        last, self._last = self._last or {}, now
        wait = slices = 0
        for tid, (w, s) in now.items():
            w0, s0 = last.get(tid, (0, 0))
            wait, slices = wait + max(0, w - w0), slices + max(0, s - s0)
        return RunQueueDelta(wait / 1e9, slices)


class ThreadPace:
    """The threads an executor computes its next graph with: the policy's count, sampled from the
    run queue once a window (`threads_now` before each call, `call_done` after it). With
    `torch_threads` torch's intra-op threads follow the count too (their OpenMP barriers wait as
    ggml's do), and `close` gives torch back the count it had. Not adaptive, a ceiling of one, or
    no run-queue signal here: always the ceiling."""

    def __init__(self, ceiling: int, adaptive: bool = True, torch_threads: bool = False,
                 reader: RunQueueWait | None = None, clock: Callable[[], float] = time.monotonic):
        self.policy = ThreadPolicy(ceiling)
        self.reader = (reader or RunQueueWait()) if adaptive and ceiling > 1 else None
        self.adaptive = self.reader is not None and self.reader.available
        self.clock = clock
        self.threads = ceiling
        self._torch_before = torch.get_num_threads() if torch_threads else None
        self._window_start = self._last_call = clock()
        self._apply()

    def threads_now(self) -> int:
        if not self.adaptive:
            return self.threads
        assert self.reader is not None
        now = self.clock()
        if now - self._last_call > IDLE_S:  # a new window from here
            self.reader.delta()
            self._window_start = now
        elif now - self._window_start >= SAMPLE_S:
            d = self.reader.delta()
            if d is None:
                self.adaptive = False
                return self.threads
            wall = now - self._window_start
            k = self.policy.observe(wall, d.wait_s, d.slices)
            self._window_start = now
            if k != self.threads:
                log.debug("threads %d -> %d: %.2f threads waiting for a core, %.0f us a slice", self.threads, k,
                          d.wait_s / wall, 1e6 * d.wait_s / max(1, d.slices))
                self.threads = k
                self._apply()
        return self.threads

    def call_done(self) -> None:
        if self.adaptive:
            self._last_call = self.clock()

    def close(self) -> None:
        if self._torch_before is not None:
            torch.set_num_threads(self._torch_before)
            self._torch_before = None

    def describe(self) -> str:
        return (f"adapting to the run queue, at most {self.policy.ceiling}" if self.adaptive
                else f"fixed at {self.policy.ceiling}")

    def _apply(self) -> None:
        if self._torch_before is not None:
            torch.set_num_threads(self.threads)
