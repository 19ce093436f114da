"""A stage's decode step of a batch of sequences captured as a CUDA graph and replayed for every
token while the batch keeps the same sequences.

At batch 1 a token's work is thousands of small launches; from Python they cost far more than
the GPU needs to run them. `Decoder.step_static` keeps every shape and address fixed (the KV
cache's whole capacity under a mask, the position on the device), so one capture serves every
token until the batch or one of its caches changes (a request joining or leaving the batch
costs one capture). Only the device path that never synchronizes the
host can be captured: CUDA kernels, grouped GEMM, experts gathered by address.

Each stage of a split captures its own layers (the first from the token id, the last to the
logits, the others hidden row to hidden row); the hand-over between stages stays outside the
graphs (the exchange's copy kernel and events, queued between the replays).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata_mgpu.model.decoder import Decoder
from strata_mgpu.model.kv_cache import KVCache


def graph_key(kv: KVCache) -> tuple[int, int, int, int]:
    """What a capture bakes in: the cache object, its keys' and values' addresses, its capacity
    (a new cache may reuse a freed one's id and keys' address, with its values elsewhere)."""
    return id(kv), kv.k.data_ptr(), kv.v.data_ptr(), kv.capacity


def batch_key(kvs: Sequence[KVCache]) -> tuple[tuple[int, int, int, int], ...]:
    """A batch's capture key: its caches' keys, in row order."""
    return tuple(graph_key(kv) for kv in kvs)


class DecodeGraph:
    def __init__(self, model: Decoder, kvs: Sequence[KVCache], inp: torch.Tensor):
        """inp: the first step's input, token ids [B] (first stage) or hidden rows [B, D], row b
        of sequence kvs[b]. The graph serves this batch of sequences, in this order, until one of
        their caches is reallocated or the batch changes (`key`)."""
        device = self.device = model.device
        self.key = batch_key(kvs)
        self.inp = inp.to(device).clone()  # the replays' input buffer
        self.positions = torch.tensor([kv.length for kv in kvs], dtype=torch.long).to(device)  # [B]
        with torch.cuda.device(device):  # the capture stream is the current device's: the stage's
            # Warm up outside the capture (lazy initializations may not happen inside it). The
            # warm-up computes the real next step, writing the very KV slots the replays write again.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                model.step_static(self.inp, self.positions, kvs)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # torch's default capture stream is made once, on whichever device captured first: a
            # stage on another card would be captured on that card's stream. Each capture gets one
            # of its own device's.
            with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device), capture_error_mode="relaxed"):
                self.out = model.step_static(self.inp, self.positions, kvs)  # [B, V] logits or [B, D] hidden

    def step(self, kvs: Sequence[KVCache], inp: torch.Tensor) -> torch.Tensor:
        """The step's output for `inp` at the caches' next positions; advances the caches."""
        assert batch_key(kvs) == self.key, "the graph belongs to another batch"
        self.inp.copy_(inp.reshape(self.inp.shape), non_blocking=True)
        if len(kvs) == 1:
            self.positions.fill_(kvs[0].length)
        else:  # a pageable source: copied out before this returns, so the list may change after
            self.positions.copy_(torch.tensor([kv.length for kv in kvs], dtype=torch.long), non_blocking=True)
        with torch.cuda.device(self.device):
            self.graph.replay()
        for kv in kvs:
            kv.advance(1)
        return self.out.clone()  # the next replay overwrites the graph's own buffer
