"""Routed experts streamed from the pinned host arena: the `ExpertBackend` of a device stage.

Shape legend: T = token rows, D = hidden, E = experts, A = experts per token, M = T * A routed
rows, F = expert width, G = experts present in this call.

Two ways to bring a layer's experts in, picked per forward by how many rows it has:
- stream: the whole layer goes up through the ring, one layer ahead of compute (prefill);
- gather: only the experts the rows picked, each read where it lives, a VRAM cache slot or the
  mapped pinned arena (decode; no host sync). On CUDA two fused kernels compute them straight from
  their quantized bytes (`cuda_src/moe_decode.cu`); the twin dequantizes them into the workspace.
Streamed layers are dequantized to bf16 on the device and computed as one grouped GEMM pair over
the rows sorted by expert.
"""

from __future__ import annotations

import torch

from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.kernels.routing import combine, group_rows, masked_combine
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.split.peer_prefill import PeerPrefill
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.expert_cache import ExpertCache
from strata_mgpu.stage.expert_ring import ExpertRing, LayerFeed
from strata_mgpu.stage.host_arena import ExpertLayout, HostExpertArena


class StreamedExperts:
    """The `ExpertBackend` of a stage: its layers' experts from the host arena, via the ring or
    gathered by address. Owns the bf16 workspace of one layer's experts."""

    def __init__(self, ctx: DeviceContext, spec: ModelSpec, arena: HostExpertArena, kernels: TorchKernels,
                 ring: ExpertRing, cache: ExpertCache | None, layers: range, dtype: torch.dtype = torch.bfloat16):
        self.ctx, self.spec, self.arena, self.kernels, self.ring, self.cache = ctx, spec, arena, kernels, ring, cache
        self.layers = layers  # global layer ids, in order; forward() gets the index into them
        E, F, D = spec.n_experts, spec.expert_ffn, spec.hidden
        # one layer's experts as bf16: the GEMMs' operands (E x 2F x D and E x D x F)
        self.w_gate_up = ctx.label(torch.empty(E, 2 * F, D, dtype=dtype, device=ctx.device), "workspace gate-up")
        self.w_down = ctx.label(torch.empty(E, D, F, dtype=dtype, device=ctx.device), "workspace down")
        self._feed: LayerFeed | None = None  # this forward's uploads, when streaming
        self.streaming = False
        self.helper: PeerPrefill | None = None  # bound for one-chunk prompts by the split runner

    @property
    def workspace_bytes(self) -> int:
        return (self.w_gate_up.numel() + self.w_down.numel()) * self.w_gate_up.element_size()

    def should_stream(self, n_rows: int) -> bool:
        """Whole layers when the rows will touch most experts anyway (or there is no cache)."""
        return self.cache is None or n_rows * self.spec.n_experts_used >= self.spec.n_experts

    @property
    def helped(self) -> bool:
        return self.streaming and self.helper is not None and self.helper.bound

    def begin(self, n_rows: int) -> None:
        self.streaming = self.should_stream(n_rows)
        self._feed = LayerFeed(self.ring, len(self.layers), self._source) if self.streaming else None
        if self.helped:
            self.helper.begin()

    def _source(self, i: int) -> tuple[int, torch.Tensor]:
        """Layer i's experts for the ring: all of them, or the busy stage's share when helped."""
        layer = self.layers[i]
        src = self.arena.layer(layer)
        return layer, src[:self.helper.split(layer)[1]] if self.helped else src

    def forward(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        lay = self.arena.layouts[layer]
        if self.cache is not None:
            self.cache.observe(i, experts)
        if not self.streaming:
            return self._forward_cached(i, lay, h, weights, experts)
        helper = self.helper if self.helped else None
        if helper is not None:  # hand the helper its inputs first: it works while we do
            helper.publish(h, weights, experts)
            helper.run_layer(i, self.spec.n_experts)
        mine = helper.split(layer)[0] if helper is not None else self.spec.n_experts  # our experts: 0..mine-1
        assert self._feed is not None
        self.ctx.access((self.w_gate_up, self.w_down), "w")
        self.kernels.dequant_experts(self._feed.acquire(i), lay, mine, self.w_gate_up, self.w_down)
        self._feed.release(i)  # dequant was the slot's only reader: the next upload may start
        order, offs = group_rows(experts, self.spec.n_experts)  # our experts' rows sort first
        self.ctx.access((self.w_gate_up, self.w_down), "r")
        y = self.kernels.grouped_mlp(h[order // experts.shape[1]], offs[:mine], self.w_gate_up[:mine],
                                     self.w_down[:mine])
        if helper is None:
            return combine(y, order, weights)
        return masked_combine(y, order, weights, experts < mine) + helper.collect()

    def _forward_cached(self, i: int, lay: ExpertLayout, h: torch.Tensor, weights: torch.Tensor,
                        experts: torch.Tensor) -> torch.Tensor:
        """Each row's picks read where they live, a VRAM slot or the mapped arena (M = T * A < E
        here): fused kernels on CUDA, no host sync on the device path."""
        assert self.cache is not None
        self.ctx.access((self.w_gate_up, self.w_down), "w")  # the torch twin dequantizes the picks there
        return self.kernels.moe_gathered(self.cache, i, lay, h, weights, experts, self.w_gate_up, self.w_down)
