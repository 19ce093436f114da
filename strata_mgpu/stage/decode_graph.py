"""A stage's decode step of one sequence captured as a CUDA graph and replayed for every token.

At batch 1 a token's work is thousands of small launches; from Python they cost far more than
the GPU needs to run them. `Decoder.step_static` keeps every shape and address fixed (the KV
cache's whole capacity under a mask, the position on the device), so one capture serves every
token until the sequence or its cache changes. Only the device path that never synchronizes the
host can be captured: CUDA kernels, grouped GEMM, experts gathered by address.

Each stage of a split captures its own layers (the first from the token id, the last to the
logits, the others hidden row to hidden row); the hand-over between stages stays outside the
graphs (the exchange's copy kernel and events, queued between the replays).
"""

from __future__ import annotations

import torch

from strata_mgpu.model.decoder import Decoder
from strata_mgpu.model.kv_cache import KVCache


def graph_key(kv: KVCache) -> tuple[int, int, int, int]:
    """What a capture bakes in: the cache object, its keys' and values' addresses, its capacity
    (a new cache may reuse a freed one's id and keys' address, with its values elsewhere)."""
    return id(kv), kv.k.data_ptr(), kv.v.data_ptr(), kv.capacity


class DecodeGraph:
    def __init__(self, model: Decoder, kv: KVCache, inp: torch.Tensor):
        """inp: the first step's input, a token id [1] (first stage) or a hidden row [1, D]."""
        device = self.device = model.device
        self.key = graph_key(kv)
        self.inp = inp.to(device).reshape(1, *inp.shape[1:]).clone()  # the replays' input buffer
        self.position = torch.full((1,), kv.length, dtype=torch.long, device=device)
        # Warm up outside the capture (lazy initializations may not happen inside it). The warm-up
        # computes the real next step, writing the very KV slot the replays write again.
        with torch.cuda.device(device):  # the capture stream is the current device's: the stage's
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                model.step_static(self.inp, self.position, kv)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # torch's default capture stream is made once, on whichever device captured first: a
            # stage on another card would be captured on that card's stream. Each capture gets one
            # of its own device's.
            with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device), capture_error_mode="relaxed"):
                self.out = model.step_static(self.inp, self.position, kv)  # [1, V] logits or [1, D] hidden

    def step(self, kv: KVCache, inp: torch.Tensor) -> torch.Tensor:
        """The step's output for `inp` at the cache's next position; advances the cache."""
        assert graph_key(kv) == self.key, "the graph belongs to another cache"
        self.inp.copy_(inp.reshape(self.inp.shape), non_blocking=True)
        self.position.fill_(kv.length)
        with torch.cuda.device(self.device):
            self.graph.replay()
        kv.advance(1)
        return self.out.clone()  # the next replay overwrites the graph's own buffer
