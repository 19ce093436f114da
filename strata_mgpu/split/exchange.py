"""The hand-over between two stages: activations through mapped pinned host memory.

Stage k writes its output rows into a host buffer with the `copy_f32_wide` kernel (16-byte stores
through the buffer's device mapping) and records an event; stage k+1's stream waits on it and
reads the rows with the same kernel. No cudaMemcpyPeer (without P2P the driver stages it through
the host, and it would queue on the copy engines behind the expert uploads), no host sync. Two
buffers alternate; a buffer is rewritten only after its reader's event.

An event wait covers only the records already issued on the host. Where writer and reader queue
from different threads, the writer could run a whole round ahead and wait on a read record not
yet issued (on nothing). So with `bounded=True` a send first takes one of `n_buffers` host
tokens, and the receive that queued the buffer's read gives it back.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.host.pinned import host_buffer


class Exchange:
    def __init__(self, src: DeviceContext, dst: DeviceContext, src_kernels: TorchKernels, dst_kernels: TorchKernels,
                 max_bytes: int, n_buffers: int = 2, name: str = "hand-over", bounded: bool = False):
        self.src, self.dst = src, dst
        self.src_kernels, self.dst_kernels = src_kernels, dst_kernels
        pin = src.is_cuda or dst.is_cuda
        self.buffers = [src.label(host_buffer(max_bytes, pin=pin), f"{name} to {dst.name} buffer {i}")
                        for i in range(n_buffers)]
        self.sent = [src.event(f"{name} to {dst.name} buffer {i} sent") for i in range(n_buffers)]  # by the writer
        self.read = [dst.event(f"{name} from {src.name} buffer {i} read") for i in range(n_buffers)]  # by the reader
        self._next = 0
        self._pending: deque[tuple[int, torch.Size, torch.dtype]] = deque()
        # writer and reader on two threads: a send waits (host) for a buffer whose read is queued
        self._free = threading.Semaphore(n_buffers) if bounded else None
        self.bytes_moved = 0

    @property
    def max_bytes(self) -> int:
        return self.buffers[0].numel()

    def send(self, x: torch.Tensor) -> None:
        """On the writer's current stream: put x [T, D] into the next buffer."""
        nbytes = x.numel() * x.element_size()
        assert nbytes <= self.max_bytes, f"{nbytes} bytes exceed the exchange's {self.max_bytes}"
        if self._free is not None:
            self._free.acquire()  # the reader has queued its read of this buffer's last rows
        b = self._next
        self._next = (b + 1) % len(self.buffers)
        self.src.wait(self.read[b])  # its reader is done
        self.src.access(self.buffers[b], "w")
        self.src.access(x, "r")
        self.src_kernels.copy_wide(self.buffers[b][:nbytes], x.contiguous())
        self.src.record(self.sent[b])
        self._pending.append((b, x.shape, x.dtype))
        self.bytes_moved += nbytes

    def receive(self) -> torch.Tensor:
        """On the reader's current stream: the oldest rows sent, on the reader's device."""
        b, shape, dtype = self._pending.popleft()
        self.dst.wait(self.sent[b])
        self.dst.access(self.buffers[b], "r")
        out = torch.empty(shape, dtype=dtype, device=self.dst.device)
        self.dst.access(out, "w")
        self.dst_kernels.copy_wide(out, self.buffers[b][:out.numel() * out.element_size()])
        self.dst.record(self.read[b])
        if self._free is not None:
            self._free.release()
        return out

    def drop_pending(self) -> int:
        """Forget the rows sent but not received (their reader's pass failed), so the next receive reads the
        next send's rows. Returns how many."""
        dropped = len(self._pending)
        self._pending.clear()
        if self._free is not None:
            for _ in range(dropped):
                self._free.release()  # the tokens their receives would have given back
        return dropped
