"""A stage's handle on its device: the torch device, the stage's own compute and upload streams,
and its VRAM budget.

Not a CUDA context: every stage on a card shares the process's primary context (and the caching
allocator). What a stage owns is its streams, so two stages on one card still queue their work
independently. On the CPU the streams are None and every step runs in program order.

Every stream and event operation of the package goes through a context, and so does every use of
a buffer that another stream may touch (`label` where allocated, `access` where used): the
torch.cuda calls on CUDA, no-ops on the plain CPU, and under `streams.ordering_twin()` (or
`twin=`) twin streams where a missing wait raises `OrderingError`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from strata_mgpu.stage.streams import (
    CudaStreams,
    Event,
    InOrderStreams,
    Mark,
    OrderingTwin,
    Stream,
    StreamBackend,
    TwinStreams,
    active_twin,
)

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
    # CPU only: check the stream ordering in this twin session (None: the active one, if any)
    twin: OrderingTwin | None = field(default=None, kw_only=True)
    name: str = field(default="", kw_only=True)  # in messages; default: the device (twin: cpu0, cpu1, ..)
    compute: Stream = field(default=None, init=False)
    upload: Stream = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._streams: StreamBackend[Any, Any]
        if self.twin is None and self.device.type == "cpu":
            self.twin = active_twin()
        if self.twin is not None:
            if self.device.type != "cpu":
                raise DeviceError(f"the ordering twin runs on the CPU, not on {self.device}")
            self.name = self.name or f"cpu{self.twin.contexts}"
            self.twin.contexts += 1
            self._streams = TwinStreams(self.twin, self.name)
        elif self.device.type == "cuda":
            self.device = check_device(self.device)
            self._streams = CudaStreams(self.device)
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
        elif self.device.type == "cpu":
            self._streams = InOrderStreams()
        else:
            raise DeviceError(f"device {self.device} is not supported (cpu or cuda:N)")
        self.name = self.name or str(self.device)
        self.compute = self._streams.new_stream("compute")
        self.upload = self._streams.new_stream("upload")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def on_compute(self, *, after_caller: bool = True, join_caller: bool = True) -> Iterator[None]:
        """Run the enclosed work on this stage's compute stream; GPU-side waits, no host sync.

        after_caller: the work waits for the caller's stream. join_caller: the caller's stream waits for
        the work. Pipeline stages skip both where the exchange's events order them: chaining every stage
        through the caller's stream would serialize chunk c+1 behind chunk c."""
        if self.compute is None:
            yield
            return
        caller = self.current_stream()
        if after_caller:
            self.wait_stream(caller, on=self.compute)
        with self.use(self.compute):
            yield
        if join_caller:
            self.wait_stream(self.compute, on=caller)

    # --- streams and events: torch.cuda on CUDA, no-ops on the CPU, checked by the twin ---------

    def new_stream(self, kind: str) -> Stream:
        """Another stream of this device (None on the plain CPU); `kind` names it in the twin's messages."""
        return self._streams.new_stream(kind)

    def event(self, name: str = "") -> Event:
        """A new event (None on the plain CPU); `name` is for the twin's messages."""
        return self._streams.event(name)

    def current_stream(self) -> Stream:
        return self._streams.current_stream()

    def use(self, stream: Stream) -> contextlib.AbstractContextManager:
        return self._streams.use(stream)

    def record(self, event: Event, stream: Stream = None) -> None:
        if event is not None:
            self._streams.record(event, stream)

    def wait(self, event: Event, stream: Stream = None) -> None:
        """`stream` (default: current) waits on the device for the event's latest record; an event never
        recorded is no wait (as on CUDA)."""
        if event is not None:
            self._streams.wait(event, stream)

    def wait_stream(self, stream: Stream, on: Stream = None) -> None:
        if stream is not None:
            self._streams.wait_stream(stream, on)

    def synchronize(self, stream: Stream = None) -> None:
        self._streams.synchronize(stream)

    def synchronize_device(self) -> None:
        """The host waits for every stream of the device: before freeing memory that work on a stream
        the caller does not know may touch."""
        self._streams.synchronize_device()

    def synchronize_event(self, event: Event) -> None:
        """The host waits for the event's latest record (a CUDA event on a plain CPU context too)."""
        if event is not None:
            self._streams.synchronize_event(event)

    def mark(self, stream: Stream = None) -> Mark:
        """A timing mark on `stream`: `later.seconds_since(earlier)`, `done()`. Orders nothing."""
        return self._streams.mark(stream)

    def capture(self, graph: torch.cuda.CUDAGraph, pool: Any, stream: Stream, mode: str = "relaxed"
                ) -> contextlib.AbstractContextManager[object]:
        """Capture the enclosed work into `graph` on `stream`, its memory from `pool` (None: its own; CUDA
        only); `mode`: torch's capture_error_mode ("relaxed": other threads' CUDA calls are not errors)."""
        return self._streams.capture(graph, pool, stream, mode)

    def current(self) -> contextlib.AbstractContextManager:
        return self._streams.current_device()

    def record_stream(self, tensors: torch.Tensor | tuple | list, stream: Stream = None) -> None:
        """Do not reuse `tensors`' memory before the work now queued on `stream` is done (torch's
        `record_stream`). No-op on the CPU."""
        self._streams.record_stream(list(tensors) if isinstance(tensors, (tuple, list)) else [tensors], stream)

    def access(self, buffer: torch.Tensor | str | tuple | list, mode: str) -> None:
        """Declare that the current stream reads ('r') or writes ('w') `buffer` (a tensor's whole storage,
        a name, or several): checked by the twin only."""
        self._streams.access(buffer, mode)

    def label(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Name a shared buffer for the twin's messages; returns it."""
        self._streams.label(buffer, name)
        return buffer

    def vram_free_in_budget(self) -> int:
        if not self.is_cuda:
            return 2**62
        free, total = torch.cuda.mem_get_info(self.device)
        cap = self.max_vram_bytes if self.max_vram_bytes is not None else total
        return max(0, min(free, cap - torch.cuda.memory_reserved(self.device)))


class HostCopy:
    """A device tensor's copy into pinned host memory, queued behind an event without a host wait;
    `wait()` gives the host tensor once it has landed. A host tensor is copied at once."""

    def __init__(self, tensor: torch.Tensor):
        self._ready: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tensor.device))
        else:
            self.host = tensor.clone()

    def ready(self) -> bool:
        """Has the copy landed? Never waits."""
        return self._ready is None or self._ready.query()

    def wait(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
        return self.host


def check_device(device: torch.device) -> torch.device:
    """The device, its CUDA index made explicit, once it is known to exist (DeviceError otherwise)."""
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceError(f"device {device} is not supported (cpu or cuda:N)")
    if not torch.cuda.is_available():
        raise DeviceError(f"{device} was asked for, but torch sees no CUDA device")
    if (device.index or 0) >= torch.cuda.device_count():
        raise DeviceError(f"{device} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    return torch.device("cuda", device.index or 0)


def parse_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:1' or '1' -> torch.device."""
    name = name.strip()
    if name.isdigit():
        return torch.device("cuda", int(name))
    try:
        return torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r} (cpu, cuda, cuda:N or N)") from None
