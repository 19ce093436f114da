"""A stage's decode steps as CUDA graphs: the bucket each batch takes, its capture, and what
happens when a capture cannot be made.

Shape legend: B = rows of a decode step, D = hidden.

A batch of B rows replays its bucket's graph: where every expert is resident the next power of
two, padded with a dummy sequence; else B itself, since pad rows would read experts over the link.
A sequence past the cells a graph covers recaptures its bucket's graph at twice as many. A capture
that runs out of memory leaves its bucket eager for CAPTURE_RETRY_STEPS steps; one this torch
cannot make lowers the largest bucket (or turns graphs off). A hybrid model's batch comes with its
rows' DeltaNet states (`linear`), whose slots a replay reads from its own buffer (capture.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from strata_mgpu.model.decoder import Decoder
from strata_mgpu.model.kv_cache import KVCache, SequenceKV
from strata_mgpu.model.linear_state import LinearState
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.graphs.capture import DecodeGraph, GraphCapture, bucket_for

log = logging.getLogger("strata.stage")
# Cells a decode graph covers at least, where its caches hold that many (a sequence past them
# recaptures its batch's graph, at twice as many): more would make every step's attention launch
# blocks for cells no short sequence has.
WARM_GRAPH_CELLS = 4096
# Steps a batch size decodes eagerly after its capture ran out of memory, before capturing again
# (each try costs a warm-up step, a device sync and an empty_cache).
CAPTURE_RETRY_STEPS = 256


class DecodeGraphs:
    """The decode graphs of one stage, by bucket. `enabled`: the stage can replay graphs at all;
    `largest`: the largest batch replayed (lowered where a capture fails); `pad`: buckets pad to
    powers of two. `first`: the stage embeds token ids (else it takes hidden rows [B, D])."""

    def __init__(self, ctx: DeviceContext, model: Decoder, *, enabled: bool, largest: int, pad: bool,
                 first: bool):
        self.ctx, self.model = ctx, model
        self.enabled, self.largest, self.pad, self.first = enabled, largest, pad, first
        self.captured: dict[int, DecodeGraph] = {}  # bucket -> its capture
        self._pad_kv: KVCache | None = None  # the dummy sequence padding a batch to its bucket
        self._capture_state: GraphCapture | None = None  # the stream and pool the graphs share (at the first capture)
        self._retry_in: dict[int, int] = {}  # bucket -> steps until its capture is tried again, after one ran out

    def bucket(self, rows: int) -> int:
        return bucket_for(rows, self.largest, pad=self.pad)

    def serves(self, kvs: Sequence[SequenceKV], linear: Sequence[LinearState] | None = None) -> bool:
        """Graphs on, a batch no larger than the largest, every cache holding its cells in place, too few
        rows to make the experts stream, and on a hybrid model every row's DeltaNet state given, none
        asked to record a snapshot after this token (`LinearState.mark`: the eager step records it)."""
        hybrid = self.model.states is not None
        if hybrid and (linear is None or len(linear) != len(kvs)
                       or any(st.cuts(st.length, 1) for st in linear)):
            return False
        return (self.enabled and len(kvs) <= self.largest and all(kv.graph_capturable for kv in kvs)
                and not self.model.experts.should_stream(self.bucket(len(kvs))))

    def drop(self) -> None:
        self.captured.clear()
        self._retry_in.clear()

    def step(self, kvs: Sequence[SequenceKV], inp: torch.Tensor,
             linear: Sequence[LinearState] | None = None) -> torch.Tensor | None:
        """The step as a replay of its bucket's graph, captured where needed; None where no capture could
        be made (the caller runs the step eagerly). Advances the caches and `linear` (a hybrid's rows'
        DeltaNet states)."""
        for kv in kvs:
            kv.reserve(1)
        bucket = self.bucket(len(kvs))
        graph = self.captured.get(bucket)
        if graph is None or not graph.fits(kvs):
            self.captured.pop(bucket, None)
            graph = None  # the old capture's memory goes before a new one is made
            if self._retry_in.get(bucket, 0) > 0:  # out of memory lately: eager, no capture tried
                self._retry_in[bucket] -= 1
                return None
            try:
                # at least as many cells as a graph captured ahead covers: no recapture below that
                # (a paged sequence's capacity grows by blocks: its longest, or it would recapture as it grows)
                cells = min(WARM_GRAPH_CELLS, max(kv.max_length for kv in kvs))
                graph = self.captured[bucket] = DecodeGraph(self.model, kvs, inp, bucket, self._pad(), cells,
                                                            capture=self._capture())
            except torch.OutOfMemoryError:  # no room for this capture now: eager for a while
                self._retry_in[bucket] = CAPTURE_RETRY_STEPS
                log.warning("no memory to capture a decode graph of %d rows on %s: such batches decode eagerly for "
                            "the next %d steps", bucket, self.ctx.device, CAPTURE_RETRY_STEPS)
                return None
            except RuntimeError as e:  # a capture this torch cannot make: no graphs this large from now on
                self._give_up(bucket, e)
                return None
        return graph.step(kvs, inp, linear)

    def warm(self, context: int, kv_cells: int) -> list[int]:
        """Capture every bucket's graph before the first request (min(context, kv_cells, WARM_GRAPH_CELLS)
        cells), so no first batch waits for it; the buckets captured (a failed one waits for first use)."""
        if not self.enabled:
            return []
        sizes = sorted({self.bucket(n) for n in range(1, self.largest + 1)})
        sizes = [b for b in sizes if not self.model.experts.should_stream(b)]
        cells = min(context, kv_cells, WARM_GRAPH_CELLS)
        spec, device = self.model.spec, self.ctx.device
        done = []
        pad = self._pad()
        for b in sizes:
            inp = (torch.zeros(b, dtype=torch.long, device=device) if self.first else
                   torch.zeros(b, spec.hidden, dtype=self.model.w.dtype, device=device))
            try:
                graph = DecodeGraph(self.model, [pad] * b, inp, b, pad, cells, capture=self._capture())
            except RuntimeError as e:
                log.warning("capturing the decode graph of %d rows on %s ahead of time failed (%s): left to its "
                            "first use", b, device, e)
                break
            if graph.only is not None:  # an op ran its twin: the graph serves the dummy batch alone
                break
            self.captured[b] = graph
            done.append(b)
        return done

    def _give_up(self, bucket: int, e: RuntimeError) -> None:
        """A capture of `bucket` rows failed for good: no graphs that large, or none where even one row failed."""
        if bucket > 1:
            self.largest = max(1, bucket - 1 if bucket & (bucket - 1) else bucket // 2)
            log.warning("CUDA graph capture of a batch of %d failed on %s (%s): batches above %d decode without "
                        "graphs", bucket, self.ctx.device, e, self.largest)
            self.captured = {b: g for b, g in self.captured.items() if b <= self.largest}
        else:
            log.warning("CUDA graph capture failed on %s (%s): decoding without graphs", self.ctx.device, e)
            self.enabled = False
            self.captured = {}

    def _pad(self) -> KVCache:
        if self._pad_kv is None:
            self._pad_kv = self.model.new_cache(1, capacity=1)
        return self._pad_kv

    def _capture(self) -> GraphCapture:
        if self._capture_state is None:
            self._capture_state = GraphCapture(self.ctx)
        elif not self.captured:
            # a pool whose every graph is gone may not be captured into again (torch frees it at the
            # next empty_cache only if all its blocks are free): a new one, on the same stream
            self._capture_state.new_pool()
        return self._capture_state
