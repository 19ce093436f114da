"""How many threads a CPU stage computes on while other processes want its cores: a pure policy.

ggml's barrier between a graph's steps spins (x86 `pause`, no yield, no futex): when the OS takes a
core from one of the pool's threads to run another process, every other thread spins until that
one runs again, up to a scheduler slice (milliseconds) a barrier, and a decode step has hundreds of
barriers. So on a shared host fewer threads than cores may be faster, down to one (no barrier at
all), and the right count moves with the other load; on a quiet host all of them are.

Which count is faster is measured, not guessed: the executor's own calls, timed, at the current
count (the baseline) against a neighbouring count tried for PROBE_WINDOWS windows (a probe).
Calls are compared like with like, each kind of call's (its op, shape and rows) mean time against the same kind's (a
prompt's calls are not a decode step's). A probe that is faster by MARGIN moves there; one that is
not is taken back, and the next probe that way waits twice as long (from BASE_HOLD_S to
MAX_HOLD_S), so a host where the count is right pays a probe ever more rarely. The run queue says
when to look sooner: a window in which the process's threads waited for a core (`waiting`:
threads waiting, on average, from the kernel's schedstat) well above their level at this count
makes the next probe one thread down, at once. (The wait alone does not say which count is faster:
a quiet host's wake-ups wait too, many times a millisecond, for a few microseconds each.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_WINDOWS = 2  # windows a probe lasts
BASELINE_WINDOWS = 4  # the latest windows at the current count that make its baseline
MARGIN = 0.08  # a probe must be this much faster (its calls' time) to move there
BASE_HOLD_S = 1.0  # seconds at a count before a probe either way, after a move
MAX_HOLD_S = 16.0  # the longest wait between probes one way (after failed ones)
RISE = 2.0  # waiting this many times the count's usual level ...
LOAD_HIGH = 0.1  # ... and above this many threads: other processes came, probe down now


Calls = dict[tuple[int, ...], tuple[int, float]]  # a call's kind and rows -> (calls, seconds)


@dataclass
class Window:
    """One window of an executor's calls: wall seconds, each kind of call's count and seconds, and
    the threads of the process waiting for a core on average (None: not known here)."""

    wall_s: float = 0.0
    calls: Calls = field(default_factory=dict)
    waiting: float | None = None

    def add(self, kind: tuple[int, ...], seconds: float) -> None:
        n, s = self.calls.get(kind, (0, 0.0))
        self.calls[kind] = (n + 1, s + seconds)


def merged(windows: list[Window]) -> Calls:
    out: Calls = {}
    for w in windows:
        for rows, (n, s) in w.calls.items():
            n0, s0 = out.get(rows, (0, 0.0))
            out[rows] = (n0 + n, s0 + s)
    return out


def slowdown(probe: Calls, base: Calls) -> float | None:
    """The probe's calls' time over what the same calls took at the baseline's means, kind by kind
    (those both saw); None where they saw none alike."""
    spent = expected = 0.0
    for rows, (n, s) in probe.items():
        if rows in base:
            n0, s0 = base[rows]
            spent, expected = spent + s, expected + n * s0 / n0
    return spent / expected if expected > 0 else None


class ThreadPolicy:
    """Windows in, the thread count to compute with out: 1..ceiling, starting at the ceiling."""

    def __init__(self, ceiling: int):
        assert ceiling >= 1
        self.ceiling = ceiling
        self.threads = ceiling  # the count the next window computes on (a probe's while probing)
        self.settled = ceiling  # the count probes are measured against
        self.hold_s = {-1: BASE_HOLD_S, +1: BASE_HOLD_S}  # seconds at `settled` before a probe that way
        self._since = {-1: 0.0, +1: 0.0}  # seconds at `settled` since the last probe that way
        self._baseline: list[Window] = []
        self._probe: list[Window] = []
        self._waiting: float | None = None  # the settled count's usual waiting (the baseline windows' least)

    def observe(self, window: Window) -> int:
        """One window's calls (on `self.threads`) -> the threads to use from now."""
        assert window.wall_s >= 0
        if self.threads != self.settled:
            self._probe.append(window)
            if len(self._probe) >= PROBE_WINDOWS:
                self._judge()
            return self.threads
        if self._risen(window):  # the baseline from here: the load changed
            self._baseline = []
            if self.settled > 1:
                self._since[-1] = self.hold_s[-1] = BASE_HOLD_S
        self._baseline = (self._baseline + [window])[-BASELINE_WINDOWS:]
        for way in self._since:
            self._since[way] += window.wall_s
        self._waiting = self._usual_waiting()
        for way in (-1, +1):  # down first: under a new load it is the likelier one
            if 1 <= self.settled + way <= self.ceiling and self._since[way] >= self.hold_s[way] \
                    and len(self._baseline) == BASELINE_WINDOWS:
                self.threads, self._probe = self.settled + way, []
                return self.threads
        return self.threads

    def _risen(self, window: Window) -> bool:
        if window.waiting is None or self._waiting is None:
            return False
        return window.waiting > max(LOAD_HIGH, RISE * self._waiting)

    def _usual_waiting(self) -> float | None:
        seen = [w.waiting for w in self._baseline if w.waiting is not None]
        return min(seen) if seen else None

    def _judge(self) -> None:
        way = +1 if self.threads > self.settled else -1
        ratio = slowdown(merged(self._probe), merged(self._baseline))
        if ratio is not None and ratio < 1 - MARGIN:  # faster: move, and look on soon either way
            self.settled = self.threads
            self.hold_s = {-1: BASE_HOLD_S, +1: BASE_HOLD_S}
            self._since = {-1: 0.0, +1: 0.0}
            self._baseline, self._waiting = self._probe[-BASELINE_WINDOWS:], None
        else:
            self.threads = self.settled
            if ratio is not None:  # no like calls to compare: try again as soon
                self.hold_s[way] = min(MAX_HOLD_S, 2 * self.hold_s[way])
        self._since[way] = 0.0
        self._probe = []
