"""Which implementation each op of a kernel set ran, and a warning the first time a fast path
falls back.

A kernel set (`kernels.experts.TorchKernels` / `CudaKernels`, `kernels.decode_ops.CudaDecodeOps`)
counts every call of its ops under "op:path" keys ("dequant:cuda", "dequant:torch",
"copy_wide:copy_f32_wide", "copy_wide:copy_engine", "moe_gathered:fused", "moe_gathered:twin",
"grouped_mlp:grouped_mm", "grouped_mlp:loop", "rms_norm:cuda", ...), so a report can say which
paths a run took instead of the kernel set's name alone.

Counting is a Python integer increment: no host sync, nothing for a CUDA graph to capture. A
captured graph replays without running Python, so the counts are of eager calls plus the calls
made while capturing; a replayed decode step adds nothing.
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
        """A fast path `fast` of `op` was not taken: warned once per process and reason. The path
        that then runs counts itself (through `ran`)."""
        warn_once(f"{op} fell back from {fast}", reason)

    def summary(self) -> str:
        """'copy_wide:copy_f32_wide 12, dequant:cuda 96, ...' (sorted by key), or 'none'."""
        return ", ".join(f"{k} {n}" for k, n in sorted(self.items()) if n) or "none"
