"""A stage's hand-over copies on a side stream of its DeviceContext, off its compute stream.

The PeerPrefill helper's hand-overs cross through mapped host memory by copy kernels (`Exchange`,
copy_f32_wide). At 8K tokens h [T, D] bf16 is 32 MB a layer each way, ~1.4 ms at the ~23 GB/s
those copies reached on an H200, against ~3.7 ms of a layer's compute: queued on the compute
stream, every copy waited in line with the stage's own rows. Here they run beside them:

- `send(exchange, tensors)`: `ready_to_send` is recorded on the current stream after the tensors'
  writers; the side stream waits for it and sends them (the exchange's waits for its buffers'
  read events land there too). The current stream goes on at once.
- `fetch(exchange, n)`: the exchange's next n messages, received on the side stream (its waits for
  the writer's sent events land there), `received` recorded after them. `wait(tensors)` makes the
  current stream wait for that, as late as the first reader of what was fetched allows.

The side stream runs its copies in the order they were queued, which is the order the hand-over
needs anyway (a layer's inputs out, then its sums back, then the next layer's inputs).

Lifetimes: the caching allocator gives a freed block back to the stream that allocated it. The
tensors sent were allocated on the current stream and are read on the side stream; what a fetch
returns was allocated on the side stream and is read on the current one. Each is
`record_stream`ed to its reading stream, so its memory is not reused before those reads are done.

The ordering twin (`stage/streams.py`) checks both waits: the tensors sent are declared written
on the current stream before `ready_to_send` is recorded, and read on the side stream by the exchange;
what a fetch returns is declared written on the side stream by the exchange and read on the
current stream after its wait. On the plain CPU the side stream is None and all runs in order.
"""

from __future__ import annotations

import torch

from strata_mgpu.split.exchange import Exchange
from strata_mgpu.stage.device import DeviceContext


class SideCopies:
    """One stage's copies to and from host memory on a side stream of its context (see the module
    docstring). Events are reused: each wait is issued right after the record it is meant for."""

    def __init__(self, ctx: DeviceContext, name: str):
        self.ctx = ctx
        self.stream = ctx.new_stream(name)  # None on the plain CPU
        self.ready_to_send = ctx.event(f"{name} ready to send")  # current stream -> side stream
        self.received = ctx.event(f"{name} received")  # side stream -> current stream

    def send(self, exchange: Exchange, tensors: tuple[torch.Tensor, ...]) -> None:
        """Send `tensors` through `exchange` on the side stream, once the current stream's work queued
        so far (their writers) is done."""
        ctx = self.ctx
        ctx.access(tensors, "w")  # written by the ops queued so far on the current stream
        ctx.record(self.ready_to_send)
        ctx.wait(self.ready_to_send, self.stream)
        with ctx.use(self.stream):
            for x in tensors:
                exchange.send(x)
        ctx.record_stream(tensors, self.stream)  # allocated on the current stream, read on the side one

    def fetch(self, exchange: Exchange, n: int) -> tuple[torch.Tensor, ...]:
        """The `exchange`'s next n messages, received on the side stream; read them after `wait`."""
        ctx = self.ctx
        with ctx.use(self.stream):
            out = tuple(exchange.receive() for _ in range(n))
        ctx.record(self.received, self.stream)
        return out

    def wait(self, fetched: tuple[torch.Tensor, ...]) -> None:
        """The current stream waits for the last fetch, whose outputs `fetched` it reads from here."""
        ctx = self.ctx
        ctx.wait(self.received)
        ctx.record_stream(fetched)  # allocated on the side stream, read on the current one
        ctx.access(fetched, "r")
