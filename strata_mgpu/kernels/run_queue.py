"""The mechanism beside `thread_policy`: the process's run-queue wait read from the kernel, and the
pace that feeds the policy a CPU stage's executor calls, timed, and that wait.

/proc/self/task/TID/schedstat holds three numbers a thread (Linux, schedstats on: the default of
every distribution kernel): nanoseconds on a core, nanoseconds runnable on a run queue waiting for
one, and the slices it ran. Where the files cannot be read (not Linux, a restricted /proc) the
policy has the calls' times alone: it then finds a new load at its next probe rather than at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata_mgpu.kernels.thread_policy import ThreadPolicy, Window

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
    """The threads an executor computes its next graph with: the policy's count, given each window
    of calls (`threads_now` before each call, `call_done` after it, with the call's kind and
    seconds) and the run queue's wait in it where the kernel says. With `torch_threads` torch's
    intra-op threads follow the count too (their OpenMP barriers wait as ggml's do), and `close`
    gives torch back the count it had. Not adaptive, or a ceiling of one: always the ceiling."""

    def __init__(self, ceiling: int, adaptive: bool = True, torch_threads: bool = False,
                 reader: RunQueueWait | None = None, clock: Callable[[], float] = time.monotonic):
        self.policy = ThreadPolicy(ceiling)
        self.adaptive = adaptive and ceiling > 1
        self.reader = (reader or RunQueueWait()) if self.adaptive else None
        self.clock = clock
        self.threads = ceiling
        self._torch_before = torch.get_num_threads() if torch_threads else None
        self._window = Window()
        self._window_start = self._last_call = clock()
        self._apply()

    def threads_now(self) -> int:
        if not self.adaptive:
            return self.threads
        now = self.clock()
        if now - self._last_call > IDLE_S:  # a new window from here
            self._restart(now)
        elif now - self._window_start >= SAMPLE_S:
            window, self._window = self._window, Window()
            window.wall_s = now - self._window_start
            d = self.reader.delta() if self.reader is not None and self.reader.available else None
            window.waiting = d.wait_s / window.wall_s if d is not None else None
            self._window_start = now
            settled = self.policy.settled
            k = self.policy.observe(window)
            if k != self.threads:
                log.debug("threads %d -> %d: %s", self.threads, k,
                          "a probe" if k != self.policy.settled else
                          "the probe was faster" if k != settled else "the probe taken back")
                self.threads = k
                self._apply()
        return self.threads

    def call_done(self, kind: tuple[int, ...], seconds: float) -> None:
        """A call of `kind` (its op, shape and rows: calls of one kind are compared) took `seconds`."""
        if self.adaptive:
            self._window.add(kind, seconds)
            self._last_call = self.clock()

    def close(self) -> None:
        if self._torch_before is not None:
            torch.set_num_threads(self._torch_before)
            self._torch_before = None

    def describe(self) -> str:
        return f"adapting, at most {self.policy.ceiling}" if self.adaptive else f"fixed at {self.policy.ceiling}"

    def _restart(self, now: float) -> None:
        self._window, self._window_start = Window(), now
        if self.reader is not None:
            self.reader.delta()

    def _apply(self) -> None:
        if self._torch_before is not None:
            torch.set_num_threads(self.threads)
