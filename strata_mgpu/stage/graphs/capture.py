"""A stage's decode step of a batch captured as a CUDA graph and replayed for every token.

At batch 1 a token's work is hundreds of small launches, far costlier from Python than on the
GPU. `Decoder.step_static` keeps every shape and address fixed: the rows' input, positions and
caches' table are device buffers the host rewrites before each replay. So one capture serves any
batch of up to `bucket` rows (padded with a dummy sequence at position 0) whose caches fit its
capacity: a request joining or leaving costs no capture. Where experts are read over the link a
batch gets a graph of its own size (pad rows would pick experts too). A capture in which an op
ran its torch twin (which reads caches by address) serves only its own batch (`graph_key`).
The hand-over between split stages stays outside the graphs.

A hybrid model's rows name their DeltaNet states by slot (`model.state_pool`): the slot index [bucket]
is one more buffer the host rewrites before a replay, a pad row's the scratch slot. The warm-up and
the capture run every row on the scratch slot, so no sequence's state advances before its replay
(their KV writes at the rows' next cells are written again by the replay).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata_mgpu.kernels.decode_ops import kv_table_row
from strata_mgpu.model.decoder import Decoder
from strata_mgpu.model.kv_cache import KVCache, SequenceKV
from strata_mgpu.model.linear_state import LinearState
from strata_mgpu.model.state_pool import SCRATCH
from strata_mgpu.stage.device import DeviceContext


def graph_key(kv: SequenceKV) -> tuple[int, int, int, int, int]:
    """What a capture that read a cache by address bakes in (a new cache may reuse a freed one's id
    and keys' address; a paged one shares its pool's keys with every other, and its own block table
    is read by address too)."""
    table = kv.block_table.data_ptr() if kv.block_table is not None else 0
    return id(kv), kv.k.data_ptr(), kv.v.data_ptr(), kv.capacity, table


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def bucket_for(rows: int, largest: int, pad: bool = True) -> int:
    """The graph batch serving `rows` rows: the next power of two, at most `largest`; `rows` itself
    without padding."""
    return min(next_pow2(rows), largest) if pad else rows


def state_slots(linear: Sequence[LinearState] | None, bucket: int) -> list[int]:
    """What a hybrid graph's slot index holds for a replay: each row's state slot, the scratch slot for
    pad rows (all of them without states: a warm-up or capture)."""
    slots = [st.slot for st in linear] if linear is not None else []
    assert len(slots) <= bucket
    return slots + [SCRATCH] * (bucket - len(slots))


# ops that read the caches through the table when they run their CUDA kernels
TABLE_OPS = ("qk_norm_rope_kv", "attention")


class GraphCapture:
    """What a stage's decode graphs share: one stream to warm up and capture on, one memory pool.

    A stream per capture would cost a cuBLAS workspace each, and a pool per graph keeps every
    bucket's temporaries at once. Sharing the pool is safe: a replay's temporaries are dead when it
    ends, every input lives outside the pool, and each output is copied out before another replay.
    """

    def __init__(self, ctx: DeviceContext):
        # torch's default capture stream is made once, on whichever device captured first: a stage
        # on another card would be captured on that card's stream. Each stage gets its own device's.
        self.ctx = ctx
        self.stream = ctx.new_stream("graph capture")
        self.pool = torch.cuda.graph_pool_handle()

    def new_pool(self) -> None:
        """A fresh memory pool for the next captures (torch may not capture into the old one again)."""
        self.pool = torch.cuda.graph_pool_handle()


class DecodeGraph:
    def __init__(self, model: Decoder, kvs: Sequence[SequenceKV], inp: torch.Tensor, bucket: int, pad: KVCache,
                 capacity: int, *, capture: GraphCapture):
        """kvs: the first step's sequences (at most `bucket`); inp their input, token ids [B] or hidden
        rows [B, D]. Rows past len(kvs) run the dummy sequence `pad` at position 0."""
        assert 0 < len(kvs) <= bucket
        device = model.device
        ctx = self.ctx = capture.ctx
        self.bucket, self.pad = bucket, pad
        padded = [*kvs, *[pad] * (bucket - len(kvs))]
        # cells the attention's splits cover: every position a replay may read
        self.capacity = next_pow2(max(capacity, *(kv.length + 1 for kv in padded)))
        twins = model.ops.twin_runs(TABLE_OPS)
        self.inp = torch.zeros((bucket, *inp.shape[1:]), dtype=inp.dtype, device=device)  # the replays' input
        self.positions = torch.zeros(bucket, dtype=torch.long, device=device)  # [bucket]
        table = model.ops.kv_table(padded)  # None for the torch ops, which read the caches themselves
        self.table = None if table is None else table.clone()  # [bucket, KV_TABLE_COLUMNS], the graph's own
        self._table_rows: list[tuple[int, int, int, int, int]] = []  # what self.table holds, as the host last wrote it
        # a hybrid's DeltaNet state slot of each row [bucket], all scratch for the warm-up and capture
        self.slots = (torch.full((bucket,), SCRATCH, dtype=torch.long, device=device) if model.states is not None
                      else None)
        self._slot_rows = state_slots(None, bucket)  # what self.slots holds, as the host last wrote it
        self._load(kvs, inp, None)
        with ctx.current():  # the capture stream is the current device's: the stage's
            # Warm up outside the capture (lazy initializations may not happen inside it), on the
            # stream that then captures (cuBLAS keeps a workspace per stream). The warm-up computes
            # the real next step, writing the very KV slots the replays write again.
            side = capture.stream
            ctx.wait_stream(ctx.current_stream(), on=side)
            with ctx.use(side):
                model.step_static(self.inp, self.positions, padded, self.table, self.capacity, self.slots)
            ctx.wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with ctx.capture(self.graph, capture.pool, side):
                self.out = model.step_static(self.inp, self.positions, padded, self.table,
                                             self.capacity, self.slots)  # [bucket, V or D]
        # a twin read the caches at their addresses of this capture: only this batch may replay it
        self.only = (None if self.table is not None and twins == model.ops.twin_runs(TABLE_OPS)
                     else [graph_key(kv) for kv in kvs])

    def fits(self, kvs: Sequence[SequenceKV]) -> bool:
        """At most `bucket` rows, each next position covered by the capture's attention (and the very
        batch it was captured for, where the capture read the caches by address)."""
        if self.only is not None:
            return [graph_key(kv) for kv in kvs] == self.only
        return len(kvs) <= self.bucket and all(kv.length < self.capacity for kv in kvs)

    def _load(self, kvs: Sequence[SequenceKV], inp: torch.Tensor, linear: Sequence[LinearState] | None) -> None:
        n = len(kvs)
        self.inp[:n].copy_(inp.reshape(n, *self.inp.shape[1:]), non_blocking=True)
        pad = self.bucket - n
        # pageable sources: copied out before these calls return, so the lists may change after
        if self.bucket == 1:
            self.positions.fill_(kvs[0].length)  # a kernel: no copy from the host
        else:
            self.positions.copy_(torch.tensor([kv.length for kv in kvs] + [0] * pad, dtype=torch.long),
                                 non_blocking=True)
        if self.table is not None:
            rows = [kv_table_row(kv) for kv in [*kvs, *[self.pad] * pad]]
            if rows != self._table_rows:  # only when a sequence joined, left or moved its cache
                self.table.copy_(torch.tensor(rows, dtype=torch.long), non_blocking=True)
                self._table_rows = rows
        if self.slots is not None:
            slots = state_slots(linear, self.bucket)
            if slots != self._slot_rows:  # only when a sequence joined or left
                if self.bucket == 1:
                    self.slots.fill_(slots[0])
                else:
                    self.slots.copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
                self._slot_rows = slots

    def step(self, kvs: Sequence[SequenceKV], inp: torch.Tensor,
             linear: Sequence[LinearState] | None = None) -> torch.Tensor:
        """The step's output [len(kvs), V or D] at the caches' next positions; advances the caches (and
        `linear`, a hybrid's rows' DeltaNet states, which the replay updates in place)."""
        assert self.fits(kvs), "the batch outgrew this graph"
        assert (linear is not None and len(linear) == len(kvs)) == (self.slots is not None), \
            "a hybrid model's rows come with their DeltaNet states, and only theirs"
        self._load(kvs, inp, linear)
        with self.ctx.current():
            self.graph.replay()
        out = self.out[:len(kvs)].clone()  # the next replay overwrites the graph's own buffer
        for kv in kvs:  # only once nothing of the step can fail (a step redone must find them as they were)
            kv.advance(1)
        for st in linear or ():
            st.advance(1)
        return out
