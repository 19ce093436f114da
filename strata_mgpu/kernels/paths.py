"""Which implementation each op of a kernel set ran, and a warning the first time a fast path
falls back.

Every call of a kernel set's ops counts under an "op:path" key ("dequant:cuda", "dequant:torch",
"moe_gathered:fused", ...), so a report can say which paths a run took. Counting is a Python
increment: a replayed CUDA graph runs no Python, so the counts are of eager calls plus the calls
made while capturing.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("strata.kernels")
_warned: set[tuple[str, str]] = set()  # (what, reason) already logged in this process


def warn_once(what: str, reason: str) -> None:
    """Log `what` (with its reason) at WARNING the first time this process sees the pair."""
    if (what, reason) in _warned:
        return
    _warned.add((what, reason))
    log.warning("%s: %s", what, reason)


class PathCounter(Counter):
    """Counts of "op:path" keys (a `collections.Counter`)."""

    def ran(self, op: str, path: str) -> None:
        self[f"{op}:{path}"] += 1

    def fell_back(self, op: str, fast: str, reason: str) -> None:
        """A fast path `fast` of `op` was not taken: warned once per process and reason. The path that then
        runs counts itself."""
        warn_once(f"{op} fell back from {fast}", reason)

    def summary(self) -> str:
        """'copy_wide:copy_f32_wide 12, dequant:cuda 96, ...' (sorted by key), or 'none'."""
        return ", ".join(f"{k} {n}" for k, n in sorted(self.items()) if n) or "none"
