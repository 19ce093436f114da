"""A decode step of one sequence captured as a CUDA graph and replayed for every token.

At batch 1 a token's work is thousands of small launches; from Python they cost far more than
the GPU needs to run them. `Decoder.forward_static` keeps every shape and address fixed (the
KV cache's whole capacity under a mask, the position on the device), so one capture serves every
token until the sequence or its cache changes. Only the device path that never synchronizes the
host can be captured: CUDA kernels, grouped GEMM, experts gathered by address.
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
    def __init__(self, model: Decoder, kv: KVCache, token: torch.Tensor):
        device = model.device
        self.key = graph_key(kv)
        self.token = token.to(device).view(1).clone()
        self.position = torch.full((1,), kv.length, dtype=torch.long, device=device)
        # Warm up outside the capture (lazy initializations may not happen inside it). The warm-up
        # computes the real next step, writing the very KV slot the replays write again.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            model.logits(model.forward_static(self.token, self.position, kv))
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="relaxed"):
            self.logits = model.logits(model.forward_static(self.token, self.position, kv))  # [1, V]

    def step(self, kv: KVCache, token: torch.Tensor) -> torch.Tensor:
        """Logits [1, V] of `token` at the cache's next position; advances the cache."""
        assert graph_key(kv) == self.key, "the graph belongs to another cache"
        self.token.copy_(token.view(1), non_blocking=True)
        self.position.fill_(kv.length)
        self.graph.replay()
        kv.advance(1)
        return self.logits.clone()  # the next replay overwrites the graph's own buffer
