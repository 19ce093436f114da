"""The host's side of a hand-over: the `Mailbox` in mapped host memory the GPU and the host exchange
a layer's rows through, and the `HandoverWorker` thread that answers its requests.

Shape legend: T = rows of the pass, A = picks a row, D = hidden.

The worker spins while steps are in flight (`arm` before each, then IDLE_SPIN_S after the last
request) and otherwise polls every IDLE_POLL_S, so a request queued behind long work is answered
late, never missed. The flags are plain loads and stores on the host's side, which x86 keeps in
order (the build refuses other hosts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import numpy as np
import torch

from strata_mgpu.kernels.cpu_experts import CpuExperts, RateCounter
from strata_mgpu.stage.experts.share_policy import RETUNE_SAMPLES
from strata_mgpu.stage.host.arena import HostExpertArena
from strata_mgpu.stage.host.pinned import host_buffer

log = logging.getLogger("strata.stage")
T = TypeVar("T")
IDLE_SPIN_S = 0.25  # the worker spins this long after the last step was armed or answered ...
IDLE_POLL_S = 1e-3  # ... then checks the request number this often


def host_sums(executor: CpuExperts, arena: HostExpertArena, layer: int, h: torch.Tensor, picks: np.ndarray,
              weights: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """The host's part of a pass: picks [T, A] (an expert id where the host computes it, -1 elsewhere),
    weights [T, A], rows h [T, D] -> (sums of the rows with host picks [R, D] fp32, their indices [R]).
    A row's picks are padded to the widest row's count with its own first pick at weight 0."""
    if picks.shape[0] == 1:  # a decode step's one row: no padding, no row selection (host time a layer)
        sel = np.flatnonzero(picks[0] >= 0)
        ids1, w1 = picks[:, sel], weights[:, sel]
        return executor.moe(arena.layer(layer), arena.layouts[layer], h, torch.from_numpy(w1),
                            torch.from_numpy(ids1)), ONE_ROW
    mine = picks >= 0
    counts = mine.sum(axis=1)
    rows = np.flatnonzero(counts)
    width = int(counts.max())
    # each row's own picks first (a stable sort on "not mine"), then its first pick again at weight 0
    order = np.argsort(~mine[rows], axis=1, kind="stable")[:, :width]
    ids = np.take_along_axis(picks[rows], order, axis=1).astype(np.int32)
    w = np.take_along_axis(weights[rows], order, axis=1).astype(np.float32)
    pad = np.arange(width)[None, :] >= counts[rows][:, None]
    ids = np.where(pad, ids[:, :1], ids).astype(np.int32)
    w = np.where(pad, np.float32(0), w).astype(np.float32)
    x = h[torch.from_numpy(rows)] if len(rows) < h.shape[0] else h
    out = executor.moe(arena.layer(layer), arena.layouts[layer], x, torch.from_numpy(w), torch.from_numpy(ids))
    return out, rows


ONE_ROW = np.zeros(1, dtype=np.int64)  # host_sums' rows where the pass has one


class Mailbox:
    """Mapped host memory (pinned on CUDA) a stage's GPU and its worker exchange a layer's rows through:
    the request and done numbers (int64, a cache line apart), the status word, the rows, picks,
    weights and meta the GPU writes, and the sums [T, D] the host writes back."""

    def __init__(self, max_rows: int, n_used: int, hidden: int, *, pin: bool):
        self.max_rows = max_rows
        self.flags = host_buffer(256, pin=pin).view(torch.int64)  # [32]: request at 0, done at 8, status at 16
        self.h = host_buffer(4 * max_rows * hidden, pin=pin).view(torch.float32)
        self.picks = host_buffer(4 * max_rows * n_used, pin=pin).view(torch.int32)
        self.weights = host_buffer(4 * max_rows * n_used, pin=pin).view(torch.float32)
        self.meta = host_buffer(16, pin=pin).view(torch.int32)  # T, A, local layer, host picks
        self.out = host_buffer(4 * max_rows * hidden, pin=pin).view(torch.float32)
        # the share of misses the host takes: handover_send reads it each launch, the host writes it
        # (`set_share`, and 0 where the worker failed), no kernel needed, so a graph replays the latest
        self.share = host_buffer(16, pin=pin).view(torch.float32)
        self.share_np = self.share.numpy()
        self.flags_np = self.flags.numpy()
        # numpy views made once: the worker reads them every request
        self.meta_np, self.picks_np, self.weights_np = self.meta.numpy(), self.picks.numpy(), self.weights.numpy()
        self.hidden = hidden

    # what the kernels take: host addresses, which the device reads and writes through the mapping
    @property
    def request_at(self) -> int:
        return self.flags.data_ptr()

    @property
    def done_at(self) -> int:
        return self.flags.data_ptr() + 8 * 8

    @property
    def status_at(self) -> int:
        return self.flags.data_ptr() + 16 * 8

    @property
    def request(self) -> int:
        return int(self.flags_np[0])

    @property
    def done(self) -> int:
        return int(self.flags_np[8])

    @done.setter
    def done(self, value: int) -> None:
        self.flags_np[8] = value  # one aligned 8-byte store, after the sums' (x86 keeps stores in order)

    @property
    def status(self) -> int:
        return int(self.flags_np[16])


class HandoverWorker:
    """A thread serving the mailbox's requests while armed. `rates` counts what each request read and
    took, polling excluded (rows -> ExpertRate)."""

    def __init__(self, mailbox: Mailbox, executor: CpuExperts, arena: HostExpertArena, layers: range):
        self.mailbox, self.executor, self.arena, self.layers = mailbox, executor, arena, layers
        self.counter = RateCounter()
        self.samples: deque[tuple[int, float]] = deque(maxlen=RETUNE_SAMPLES)  # (bytes, seconds) a request
        self.error: BaseException | None = None
        self._armed_until = 0.0
        self._wake = threading.Event()
        self._stop = False
        self._task: tuple[Callable[[], object], Future] | None = None  # `call`'s, run between requests
        self._thread = threading.Thread(target=self._serve, name="strata cpu experts", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() run on the worker's own thread: what the worker measures, such as `probe_host_rate`, must
        run there (ggml's pool serves its caller as its first thread)."""
        done: Future = Future()
        self._task = (fn, done)
        self._wake.set()
        return done.result()

    def arm(self) -> None:
        """A step that may ask is about to be queued: poll from now until IDLE_SPIN_S after it."""
        self._armed_until = time.monotonic() + IDLE_SPIN_S
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        box = self.mailbox
        last = box.request
        while not self._stop:
            if self._task is not None:
                fn, done = self._task
                self._task = None
                try:
                    done.set_result(fn())
                except BaseException as e:
                    done.set_exception(e)
                continue
            request = box.request
            if request == last:
                if time.monotonic() > self._armed_until:  # idle: a wake from arm(), or the next check
                    self._wake.wait(IDLE_POLL_S)
                    self._wake.clear()
                else:
                    time.sleep(0)  # lets the engine's thread have the GIL between polls
                continue
            last = request
            t0 = time.perf_counter()
            try:
                rows, nbytes = self._answer()
            except BaseException as e:  # later layers give the host nothing; the next arm() detaches
                log.exception("the host's cores failed a hand-over")
                self.error = e
                box.share_np[0] = 0.0
                box.out.zero_()
                rows, nbytes = 0, 0
            self._armed_until = time.monotonic() + IDLE_SPIN_S
            box.done = request
            seconds = time.perf_counter() - t0
            self.counter.count(rows, nbytes, seconds)
            if nbytes:
                self.samples.append((nbytes, seconds))

    def _answer(self) -> tuple[int, int]:
        box = self.mailbox
        meta = box.meta_np
        t, a, i = int(meta[0]), int(meta[1]), int(meta[2])
        picks = box.picks_np[:t * a].reshape(t, a)
        weights = box.weights_np[:t * a].reshape(t, a)
        h = box.h[:t * box.hidden].view(t, box.hidden)
        out = box.out[:t * box.hidden].view(t, box.hidden)
        layer = self.layers[i]
        if not 0 < t <= box.max_rows or not (picks >= 0).any():  # not a request as handover_send writes them
            raise RuntimeError(f"a hand-over request of {t} rows with no host picks: the mailbox was overwritten")
        sums, rows = host_sums(self.executor, self.arena, layer, h, picks, weights)
        if len(rows) < t:
            out.zero_()
            out[torch.from_numpy(rows)] = sums
        else:
            out.copy_(sums)
        mine = picks[picks >= 0]
        n_experts = len(mine) if t == 1 else len(np.unique(mine))  # a row's picks are distinct
        return t, n_experts * self.arena.layouts[layer].expert_bytes
