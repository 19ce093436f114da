"""A stage's hand-over copies on a side stream of its DeviceContext, beside its compute stream.

The PeerPrefill helper's hand-overs cross through mapped host memory by copy kernels (`Exchange`,
copy_f32_wide). At 8K tokens h [T, D] bf16 is 32 MB a layer each way, ~0.7 ms a copy on the
H200s, in line with ~7 ms of a layer's compute there. Where a helped prompt runs in two halves
of rows (`PeerPrefill.overlapped`), each side's copies run on side streams instead, so that
they go on while its compute stream works on the other half:

- `send(exchange, tensors)`: `ready_to_send` is recorded on the current stream after the tensors'
  writers; the side stream waits for it and sends them (the exchange's waits for its buffers'
  read events land there too). The current stream goes on at once.
- `fetch(exchange, n)`: the exchange's next n messages, received on the side stream (its waits for
  the writer's sent events land there), an event of this fetch's own recorded after them.
  `wait(fetched)` makes the current stream wait for that fetch only, as late as its first reader
  allows; later fetches may already be queued behind it.

A side stream's copies take at most SIDE_COPY_BLOCKS blocks: a copy through mapped memory is
bound by the link's latency and needs requests in flight, not SMs, and the compute beside it
keeps the rest.

Lifetimes: the caching allocator gives a freed block back to the stream that allocated it. The
tensors sent were allocated on the current stream and are read on the side stream; what a fetch
returns was allocated on the side stream and is read on the current one. Each is
`record_stream`ed to its reading stream, so its memory is not reused before those reads are done.

The ordering twin (`stage/streams.py`) checks both waits: the tensors sent are declared written
on the current stream before `ready_to_send` is recorded, and read on the side stream by the
exchange; what a fetch returns is declared written on the side stream by the exchange and read on
the current stream after its wait. On the plain CPU the side stream is None and all runs in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata_mgpu.split.exchange import Exchange
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.streams import Event

# 64 blocks of 256 threads, one 16-byte request each in flight: ~256 KB, the link's rate at a
# couple of microseconds of latency, on 64 of an H200's 132 SMs at an eighth of their threads
SIDE_COPY_BLOCKS = 64
FETCHES_IN_FLIGHT = 4  # events a SideCopies cycles through: fetches queued ahead of their waits


@dataclass(frozen=True)
class Fetched:
    """What one `fetch` received, and the event recorded after it on the side stream."""

    tensors: tuple[torch.Tensor, ...]
    received: Event


class SideCopies:
    """One stage's copies to or from host memory on a side stream of its context (see the module
    docstring)."""

    def __init__(self, ctx: DeviceContext, name: str):
        self.ctx = ctx
        self.stream = ctx.new_stream(name)  # None on the plain CPU
        self.ready_to_send = ctx.event(f"{name} ready to send")  # current stream -> side stream, waited at once
        self._received = [ctx.event(f"{name} received {k}") for k in range(FETCHES_IN_FLIGHT)]
        self._next = 0

    def send(self, exchange: Exchange, tensors: tuple[torch.Tensor, ...]) -> None:
        """Send `tensors` through `exchange` on the side stream, once the current stream's work queued
        so far (their writers) is done."""
        ctx = self.ctx
        ctx.access(tensors, "w")  # written by the ops queued so far on the current stream
        ctx.record(self.ready_to_send)
        ctx.wait(self.ready_to_send, self.stream)
        with ctx.use(self.stream):
            for x in tensors:
                exchange.send(x, SIDE_COPY_BLOCKS)
        ctx.record_stream(tensors, self.stream)  # allocated on the current stream, read on the side one

    def fetch(self, exchange: Exchange, n: int) -> Fetched:
        """The `exchange`'s next n messages, received on the side stream; read them after `wait`.
        At most FETCHES_IN_FLIGHT fetches may be queued ahead of their waits."""
        ctx = self.ctx
        with ctx.use(self.stream):
            out = tuple(exchange.receive(SIDE_COPY_BLOCKS) for _ in range(n))
        received = self._received[self._next]
        self._next = (self._next + 1) % len(self._received)
        ctx.record(received, self.stream)
        return Fetched(out, received)

    def wait(self, fetched: Fetched) -> tuple[torch.Tensor, ...]:
        """The current stream waits for that fetch, whose tensors it reads from here; returns them."""
        ctx = self.ctx
        ctx.wait(fetched.received)
        ctx.record_stream(fetched.tensors)  # allocated on the side stream, read on the current one
        ctx.access(fetched.tensors, "r")
        return fetched.tensors
