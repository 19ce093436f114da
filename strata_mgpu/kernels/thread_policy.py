"""How many threads a CPU stage computes on while other processes want its cores: a pure policy.

ggml's barrier between a graph's steps spins (x86 `pause`, no yield, no futex): when the OS takes a
core from one of the pool's threads to run another process, every other thread spins until that
one runs again, a scheduler slice (milliseconds) a barrier, and a decode step has hundreds of
barriers. Torch's OpenMP threads wait the same way. So on a shared host fewer threads than cores
are faster, down to one (no barrier at all), and the right count moves with the other load.

The signal is the kernel's own accounting of the process's threads (`run_queue.RunQueueWait`):
over a window of wall time, the seconds they spent runnable but not running (`wait_s`) and the
times they were put on a core (`slices`). Threads lack cores when both the wait per wall second
(threads waiting, on average) and the wait per slice are high: a quiet host's waits are wake-ups,
microseconds each, however many; a contended host's are other processes' slices.

- Contended for HOT_WINDOWS windows in a row: fewer threads, by about the threads waiting on
  average (the cores the others take), at least one, at most half, never below one.
- Quiet for `hold_s`: one thread more (a probe). Contention in the windows after a probe takes it
  back and doubles `hold_s` (to MAX_HOLD_S), so a steady competitor costs a probe that often; a
  probe that held resets `hold_s` to BASE_HOLD_S, so a host that went quiet is climbed back fast.
"""

from __future__ import annotations

LOAD_HIGH = 0.05  # threads waiting for a core, on average over the window: above, a contended window...
SLICE_WAIT_HIGH_S = 200e-6  # ...when a slice also waited this long on average (a wake-up waits microseconds)
HOT_WINDOWS = 2  # contended windows in a row before threads are taken away
BASE_HOLD_S = 0.5  # quiet seconds before a probe, after a probe that held
MAX_HOLD_S = 16.0  # the longest wait between probes (after failed ones)


class ThreadPolicy:
    """Windows of (wall_s, wait_s, slices) in, the thread count to compute with out: 1..ceiling,
    starting at the ceiling."""

    def __init__(self, ceiling: int):
        assert ceiling >= 1
        self.ceiling = ceiling
        self.threads = ceiling
        self.hold_s = BASE_HOLD_S
        self._quiet_s = 0.0  # quiet wall time since the last change (or contended window)
        self._hot = 0  # contended windows in a row
        self._probing = False  # the last change added a thread, not yet held for hold_s

    @staticmethod
    def contended(wall_s: float, wait_s: float, slices: int) -> bool:
        return wall_s > 0 and wait_s / wall_s > LOAD_HIGH and wait_s / max(1, slices) > SLICE_WAIT_HIGH_S

    def observe(self, wall_s: float, wait_s: float, slices: int) -> int:
        """One window: its wall seconds, the process's threads' run-queue wait in it (seconds,
        summed over threads) and the slices they ran -> the threads to use from now."""
        assert wall_s >= 0 and wait_s >= 0 and slices >= 0
        if self.contended(wall_s, wait_s, slices):
            self._quiet_s = 0.0
            self._hot += 1
            if self._probing:  # the probe's thread found no core
                self.threads -= 1
                self.hold_s = min(MAX_HOLD_S, 2 * self.hold_s)
                self._probing, self._hot = False, 0
            elif self._hot >= HOT_WINDOWS and self.threads > 1:
                waiting = round(wait_s / wall_s)  # about the cores the others took from us
                self.threads -= min(max(1, waiting), max(1, self.threads // 2))
                self._hot = 0
            return self.threads
        self._hot = 0
        self._quiet_s += wall_s
        if self._quiet_s >= self.hold_s:
            if self._probing:
                self.hold_s = BASE_HOLD_S
            self._probing = self.threads < self.ceiling
            self.threads = min(self.ceiling, self.threads + 1)
            self._quiet_s = 0.0
        return self.threads
