"""Host buffers kept for the next sequence: a spilled sequence's KV rows live in pinned host RAM,
and making such a buffer means zero-filling and pinning every page. A sequence that ends gives
its buffers back; the next one that spills takes the smallest one large enough.

Sizes are rounded up to GRANULE so that nearby sizes serve each other. At most `keep` idle
buffers stay (the largest); all of them are freed before a new buffer is pinned when none is
large enough. A buffer given back must have no copy still running into or out of it.
"""

from __future__ import annotations

import threading

import torch

from strata_mgpu.stage.host.pinned import host_buffer

GRANULE = 16 << 20  # bytes


class HostBufferPool:
    def __init__(self, *, pin: bool, keep: int = 2, granule: int = GRANULE):
        self.pin, self.keep, self.granule = pin, keep, granule
        self._idle: list[torch.Tensor] = []  # uint8 buffers, no owner
        self._lock = threading.Lock()  # stage worker threads and a finalizer may give back at once
        self.made = 0  # buffers allocated (and pinned) so far
        self.reused = 0  # takes served from the idle ones

    def take(self, nbytes: int) -> torch.Tensor:
        """uint8 [>= nbytes] host memory (pinned and mapped when `pin`); contents undefined."""
        with self._lock:
            fits = [b for b in self._idle if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=torch.Tensor.numel)
                self._idle = [b for b in self._idle if b is not best]
                self.reused += 1
                return best
            self._idle = []  # too small for this one: unpinned before more is pinned
            self.made += 1
        return host_buffer(-(-nbytes // self.granule) * self.granule, pin=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=torch.Tensor.numel, reverse=True)
            del self._idle[self.keep:]

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._idle)
