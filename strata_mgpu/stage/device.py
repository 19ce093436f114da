"""A stage's handle on its device: the torch device, the stage's own compute and upload streams,
and its VRAM budget.

Not a CUDA context: CUDA gives a process one primary context per device, which every stage on
that card shares (and with it the caching allocator and its cap, the sum of their budgets). What a
stage owns is its streams, so two stages on one card still queue their work independently and can
overlap there as they would on two cards. On the CPU the streams are None and every
"asynchronous" step runs in program order; the same stage code runs on both.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

# The live contexts on each device: the caching allocator's cap is per process and device, so
# stages sharing a card share its cap, the sum of their budgets (none if one has no budget).
_LIVE: dict[torch.device, weakref.WeakSet[DeviceContext]] = defaultdict(weakref.WeakSet)


class DeviceError(RuntimeError):
    """The requested device cannot be used (no CUDA, bad index, budget too small)."""


@dataclass(eq=False)  # identity, so live contexts can sit in a WeakSet
class DeviceContext:
    """One stage's device, streams and VRAM budget (see the module docstring)."""

    device: torch.device
    max_vram_bytes: int | None = None  # None: no cap beyond the card
    compute: torch.cuda.Stream | None = field(default=None, init=False)
    upload: torch.cuda.Stream | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceError("CUDA was asked for, but torch sees no CUDA device")
            if (self.device.index or 0) >= torch.cuda.device_count():
                raise DeviceError(f"{self.device} does not exist ({torch.cuda.device_count()} CUDA device(s))")
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            self.compute = torch.cuda.Stream(self.device)
            self.upload = torch.cuda.Stream(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            _LIVE[self.device].add(self)
            budgets = [c.max_vram_bytes for c in _LIVE[self.device]]
            cap = None if None in budgets else sum(b for b in budgets if b is not None)
            if cap is not None and cap > total:
                raise DeviceError(f"--max-vram {cap / 2**30:.1f} GiB on {self.device} exceeds its "
                                  f"{total / 2**30:.1f} GiB")
            # The caching allocator refuses to grow past this fraction: the budget is enforced, not
            # hoped for. A stage without a budget lifts the cap for its device.
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction((cap or total) / total, self.device)
        elif self.device.type != "cpu":
            raise DeviceError(f"device {self.device} is not supported (cpu or cuda:N)")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def on_compute(self, *, after_caller: bool = True, join_caller: bool = True) -> Iterator[None]:
        """Run the enclosed work on this stage's compute stream; GPU-side waits, no host sync.

        after_caller: the work waits for what the caller's stream has queued (its inputs may come
        from there). join_caller: the caller's stream waits for the work (it will read the output).
        Stages in a pipeline skip both where the exchange's events already order them: chaining
        every stage through the caller's stream would serialize chunk c+1 behind chunk c.
        """
        if self.compute is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        if after_caller:
            self.compute.wait_stream(caller)
        with torch.cuda.stream(self.compute):
            yield
        if join_caller:
            caller.wait_stream(self.compute)

    def event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event() if self.is_cuda else None

    def vram_free_in_budget(self) -> int:
        """Bytes the stage may still allocate under its budget (or on the card)."""
        if not self.is_cuda:
            return 2**62
        free, total = torch.cuda.mem_get_info(self.device)
        cap = self.max_vram_bytes if self.max_vram_bytes is not None else total
        return max(0, min(free, cap - torch.cuda.memory_reserved(self.device)))


def parse_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:1' or '1' -> torch.device."""
    name = name.strip()
    if name.isdigit():
        return torch.device("cuda", int(name))
    try:
        return torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r} (cpu, cuda, cuda:N or N)") from None
