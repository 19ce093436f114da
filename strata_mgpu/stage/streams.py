"""Streams and events behind one small API: on CUDA, on the CPU in program order, and on the CPU as
a twin that checks their ordering.

A missing wait shows on a GPU only as a rare wrong answer, and on the plain CPU never; the twin
makes it fail in CI. It is an exact race detector, not a scheduler: CPU torch runs every op when
called, but the issue order of every stream operation and declared buffer access decides which
schedules a GPU may pick. Happens-before is tracked with vector clocks ({stream index: tick}:
program order, event record -> wait, `wait_stream`, host synchronizations), and `OrderingError`
is raised at the first access that conflicts with an unordered earlier one on another stream,
naming the stream, the buffer, both call sites and the missing wait.
`tests/ordering_schedules.py` replays recorded traces in seeded adversarial schedules: the
oracle the detector is tested against.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, Union

import torch


class OrderingError(RuntimeError):
    """Two accesses of one buffer on different streams that no wait orders (twin only)."""


@dataclass(eq=False)
class TwinStream:
    """A stream of the twin: a name and a vector clock; `home` holds its device's current stream."""

    name: str
    index: int
    home: TwinStreams | None  # None: the host
    vc: dict[int, int] = field(default_factory=dict)
    host_epoch: int = 0  # the host clock's epoch last joined into vc
    waited: set[int] = field(default_factory=set)  # events it has waited on (for messages)

    def __post_init__(self) -> None:
        self.vc[self.index] = 1


@dataclass(eq=False)
class TwinEvent:
    """An event of the twin: the clock of the stream it was last recorded on, when recorded."""

    name: str
    index: int
    vc: dict[int, int] | None = None
    stream: TwinStream | None = None


Stream = Union[torch.cuda.Stream, TwinStream, None]  # noqa: UP007 (torch.cuda.Stream is not a type on every build)
Event = Union[torch.cuda.Event, TwinEvent, None]  # noqa: UP007


@dataclass
class _Access:
    stream: TwinStream
    tick: int  # the stream's own clock entry when the access was issued
    where: str  # file:line function of the declaring call


@dataclass
class _BufferState:
    name: str
    write: _Access | None = None
    reads: dict[int, _Access] = field(default_factory=dict)  # stream index -> its last read since the write


def _join(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _where(depth: int) -> str:
    f = sys._getframe(depth)
    return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}"


class OrderingTwin:
    """One checking session: every twin stream, event and declared buffer of the contexts made with it.
    `trace=True` also records every operation (for tests/ordering_schedules.py). `cross_stream`
    counts checked cross-stream accesses found ordered: a test under the twin asserts it is > 0, so
    the check had something to catch."""

    def __init__(self, *, trace: bool = False):
        self.host = TwinStream("host", 0, None)
        self.streams: list[TwinStream] = [self.host]
        self.events: list[TwinEvent] = []
        self.buffers: dict[object, _BufferState] = {}
        self._keep: list[torch.Tensor] = []  # labelled tensors stay alive: their addresses are their keys
        self._host_epoch = 0
        self.contexts = 0
        self.trace: list[tuple] | None = [] if trace else None
        self.accesses = self.cross_stream = 0

    # --- streams and events -------------------------------------------------------------------

    def stream(self, name: str, home: TwinStreams | None) -> TwinStream:
        s = TwinStream(name, len(self.streams), home)
        _join(s.vc, self.host.vc)  # work on it is issued after the host's steps so far
        s.host_epoch = self._host_epoch
        self.streams.append(s)
        return s

    def event(self, name: str) -> TwinEvent:
        e = TwinEvent(name, len(self.events))
        self.events.append(e)
        return e

    def _issue(self, s: TwinStream) -> None:
        """Work issued now runs after everything the host has seen complete."""
        if s.host_epoch != self._host_epoch:
            _join(s.vc, self.host.vc)
            s.host_epoch = self._host_epoch

    def record(self, event: TwinEvent, s: TwinStream) -> None:
        self._issue(s)
        event.vc, event.stream = dict(s.vc), s
        s.vc[s.index] += 1  # later work on s is not covered by this record
        if self.trace is not None:
            self.trace.append(("record", s.index, event.index))

    def wait(self, event: TwinEvent, s: TwinStream) -> None:
        """s waits for the event's latest record issued so far (none yet: no wait, as on CUDA)."""
        self._issue(s)
        s.waited.add(event.index)
        if event.vc is not None:
            _join(s.vc, event.vc)
        if self.trace is not None:
            self.trace.append(("wait", s.index, event.index))

    def wait_stream(self, waiter: TwinStream, source: TwinStream) -> None:
        self._issue(waiter)
        self._issue(source)
        _join(waiter.vc, source.vc)
        source.vc[source.index] += 1
        if self.trace is not None:
            self.trace.append(("wait_stream", waiter.index, source.index))

    def synchronize_event(self, event: TwinEvent) -> None:
        if event.vc is not None:
            _join(self.host.vc, event.vc)
        self._host_epoch += 1
        if self.trace is not None:
            self.trace.append(("sync_event", None, event.index))

    def synchronize(self, s: TwinStream) -> None:
        self._issue(s)
        _join(self.host.vc, s.vc)
        s.vc[s.index] += 1
        self._host_epoch += 1
        if self.trace is not None:
            self.trace.append(("sync", s.index, None))

    # --- buffers ------------------------------------------------------------------------------

    @staticmethod
    def _key(buffer: torch.Tensor | str) -> object:
        return buffer if isinstance(buffer, str) else buffer.untyped_storage().data_ptr()

    def label(self, buffer: torch.Tensor, name: str) -> None:
        self._keep.append(buffer)
        self.buffers[self._key(buffer)] = _BufferState(name)

    def access(self, s: TwinStream, buffer: torch.Tensor | str, mode: str, where: str) -> None:
        assert mode in ("r", "w"), mode
        self._issue(s)
        key = self._key(buffer)
        state = self.buffers.get(key)
        if state is None:
            if not isinstance(buffer, str):
                self._keep.append(buffer)
            state = self.buffers[key] = _BufferState(buffer if isinstance(buffer, str) else
                                                     f"tensor {tuple(buffer.shape)} at {key:#x}")
        self.accesses += 1
        if self.trace is not None:
            self.trace.append(("access", s.index, (state.name, mode)))
        tick = s.vc[s.index]
        priors = [state.write] if mode == "r" else [state.write, *state.reads.values()]
        for p in priors:
            if p is None or p.stream is s:
                continue
            if s.vc.get(p.stream.index, 0) < p.tick:
                raise self._race(s, mode, state, p, where)
            self.cross_stream += 1
        if mode == "r":
            state.reads[s.index] = _Access(s, tick, where)
        else:  # every earlier access is ordered before this write, so before anything ordered after it
            state.write, state.reads = _Access(s, tick, where), {}

    def _race(self, s: TwinStream, mode: str, state: _BufferState, p: _Access, where: str) -> OrderingError:
        prior = "write" if p is state.write else "read"
        covering = [e for e in self.events if e.stream is p.stream and e.vc is not None
                    and e.vc.get(p.stream.index, 0) >= p.tick]
        if covering:  # the first recorded after the access
            e = min(covering, key=lambda e: ((e.vc or {})[p.stream.index], e.index))
            missing = f"a wait on {e.name!r} (recorded on {p.stream.name} after that {prior})"
        else:
            missing = (f"a wait on an event recorded on {p.stream.name} after that {prior} (none is recorded there), "
                       f"or a wait_stream of it,")
        never = [self.events[i].name for i in sorted(s.waited) if self.events[i].vc is None]
        note = f"; {s.name} waits on {never[0]!r}, which is never recorded" if never else ""
        verb = "reads" if mode == "r" else "writes"
        return OrderingError(f"{s.name} {verb} {state.name!r} at {where}, but its {prior} on {p.stream.name} at "
                             f"{p.where} is not ordered before: missing {missing} on {s.name}{note}")


_ACTIVE: list[OrderingTwin] = []


@contextlib.contextmanager
def ordering_twin(*, trace: bool = False) -> Iterator[OrderingTwin]:
    """CPU DeviceContexts made inside get twin streams of the yielded session (and keep them after)."""
    twin = OrderingTwin(trace=trace)
    _ACTIVE.append(twin)
    try:
        yield twin
    finally:
        _ACTIVE.pop()


def active_twin() -> OrderingTwin | None:
    return _ACTIVE[-1] if _ACTIVE else None


# --- timing marks -------------------------------------------------------------------------------


class HostMark:
    """A time on the host's clock: on the CPU work runs as it is queued."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def done(self) -> bool:
        return True

    def seconds_since(self, begin: Mark) -> float:
        assert isinstance(begin, HostMark)
        return self.at - begin.at


class CudaMark:
    """A timing event recorded on a stream (it orders nothing)."""

    def __init__(self, stream: torch.cuda.Stream):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)

    def done(self) -> bool:
        return self.event.query()

    def seconds_since(self, begin: Mark) -> float:
        assert isinstance(begin, CudaMark)
        self.event.synchronize()
        return begin.event.elapsed_time(self.event) / 1e3


Mark = HostMark | CudaMark


# --- the three implementations behind DeviceContext ----------------------------------------------

S = TypeVar("S")  # a backend's stream handle
E = TypeVar("E")  # a backend's event handle


class StreamBackend(Protocol[S, E]):
    """What `DeviceContext` asks of its streams; each backend knows its own handles (`S`, `E`). A
    `stream` of None is the current one."""

    def new_stream(self, kind: str) -> S: ...

    def event(self, name: str) -> E: ...

    def current_stream(self) -> S: ...

    def use(self, stream: S) -> contextlib.AbstractContextManager[object]: ...

    def record(self, event: E, stream: S | None) -> None: ...

    def wait(self, event: E, stream: S | None) -> None: ...

    def wait_stream(self, source: S, waiter: S | None) -> None: ...

    def synchronize(self, stream: S | None) -> None: ...

    def synchronize_device(self) -> None: ...

    def synchronize_event(self, event: E) -> None: ...

    def mark(self, stream: S | None) -> Mark: ...

    def current_device(self) -> contextlib.AbstractContextManager[object]: ...

    def capture(self, graph: torch.cuda.CUDAGraph, pool: Any, stream: S, mode: str
                ) -> contextlib.AbstractContextManager[object]: ...

    def record_stream(self, tensors: list[torch.Tensor], stream: S | None) -> None: ...

    def access(self, buffer: torch.Tensor | str | tuple | list, mode: str) -> None: ...

    def label(self, buffer: torch.Tensor, name: str) -> None: ...



class CudaStreams:
    """torch.cuda; declarations cost nothing."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self, kind: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def event(self, name: str) -> torch.cuda.Event:
        return torch.cuda.Event()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(stream)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream | None) -> None:
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))

    def wait(self, event: torch.cuda.Event, stream: torch.cuda.Stream | None) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    def wait_stream(self, source: torch.cuda.Stream, waiter: torch.cuda.Stream | None) -> None:
        (waiter if waiter is not None else torch.cuda.current_stream(self.device)).wait_stream(source)

    def synchronize(self, stream: torch.cuda.Stream | None) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.device)).synchronize()

    def synchronize_device(self) -> None:
        torch.cuda.synchronize(self.device)

    def synchronize_event(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def mark(self, stream: torch.cuda.Stream | None) -> Mark:
        return CudaMark(stream if stream is not None else torch.cuda.current_stream(self.device))

    def current_device(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.device(self.device)

    def capture(self, graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream, mode: str
                ) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode)

    def record_stream(self, tensors: list[torch.Tensor], stream: torch.cuda.Stream | None) -> None:
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        for t in tensors:
            t.record_stream(s)

    def access(self, buffer: torch.Tensor | str | tuple | list, mode: str) -> None:
        pass

    def label(self, buffer: torch.Tensor, name: str) -> None:
        pass


class _HostDevice:

    def current_device(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def capture(self, graph: torch.cuda.CUDAGraph, pool: Any, stream: object, mode: str
                ) -> contextlib.AbstractContextManager[object]:
        raise RuntimeError("CUDA graphs are captured on CUDA devices only")


class InOrderStreams(_HostDevice):
    """The plain CPU: no streams, no events, everything in program order."""

    def new_stream(self, kind: str) -> None:
        return None

    def event(self, name: str) -> torch.cuda.Event | None:
        return None

    def current_stream(self) -> None:
        return None

    def use(self, stream: None) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def record(self, event: torch.cuda.Event | None, stream: None) -> None:
        pass

    def wait(self, event: torch.cuda.Event | None, stream: None) -> None:
        """A card's event (`--devices cpu,0`): the host waits for it, program order being the CPU's only stream."""
        if event is not None:
            event.synchronize()

    def wait_stream(self, source: None, waiter: None) -> None:
        pass

    def synchronize(self, stream: None) -> None:
        pass

    def synchronize_device(self) -> None:
        pass

    def synchronize_event(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def mark(self, stream: None) -> Mark:
        return HostMark()


    def record_stream(self, tensors: list[torch.Tensor], stream: None) -> None:
        pass

    def access(self, buffer: torch.Tensor | str | tuple | list, mode: str) -> None:
        pass

    def label(self, buffer: torch.Tensor, name: str) -> None:
        pass


class _Use:

    def __init__(self, stream: TwinStream):
        self.stream = stream

    def __enter__(self) -> object:
        home = self.stream.home
        assert home is not None, "the host is not a stream to queue work on"
        self.previous, home.current = home.current, self.stream
        return None

    def __exit__(self, *exc: object) -> None:
        home = self.stream.home
        assert home is not None
        home.current = self.previous


class TwinStreams(_HostDevice):
    """One context's streams in a twin session: its own device, with a default stream current."""

    def __init__(self, twin: OrderingTwin, name: str):
        self.twin, self.name = twin, name
        self.default = twin.stream(f"{name}.default", self)
        self.current = self.default
        self.streams = [self.default]  # every stream of this device, for synchronize_device

    def new_stream(self, kind: str) -> TwinStream:
        s = self.twin.stream(f"{self.name}.{kind}", self)
        self.streams.append(s)
        return s

    def event(self, name: str) -> TwinEvent:
        return self.twin.event(f"{self.name} {name or f'event {len(self.twin.events)}'}")

    def current_stream(self) -> TwinStream:
        return self.current

    def use(self, stream: TwinStream) -> contextlib.AbstractContextManager[object]:
        return _Use(stream)

    def record(self, event: TwinEvent, stream: TwinStream | None) -> None:
        self.twin.record(event, stream if stream is not None else self.current)

    def wait(self, event: TwinEvent, stream: TwinStream | None) -> None:
        self.twin.wait(event, stream if stream is not None else self.current)

    def wait_stream(self, source: TwinStream, waiter: TwinStream | None) -> None:
        self.twin.wait_stream(waiter if waiter is not None else self.current, source)

    def synchronize(self, stream: TwinStream | None) -> None:
        self.twin.synchronize(stream if stream is not None else self.current)

    def synchronize_device(self) -> None:
        for s in self.streams:
            self.twin.synchronize(s)

    def synchronize_event(self, event: TwinEvent) -> None:
        self.twin.synchronize_event(event)

    def mark(self, stream: TwinStream | None) -> Mark:
        return HostMark()


    def record_stream(self, tensors: list[torch.Tensor], stream: TwinStream | None) -> None:
        pass  # CPU memory has no allocator stream, and the twin keeps every tensor it checked alive

    def access(self, buffer: torch.Tensor | str | tuple | list, mode: str) -> None:
        where = _where(3)  # the stage code that called DeviceContext.access
        for b in buffer if isinstance(buffer, (tuple, list)) else (buffer,):
            self.twin.access(self.current, b, mode, where)

    def label(self, buffer: torch.Tensor, name: str) -> None:
        self.twin.label(buffer, f"{self.name} {name}")
