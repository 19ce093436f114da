"""PeerPrefill: the idle stage's card streams and computes a share of the busy stage's experts.

A prompt that fits one chunk runs the stages one after the other, so while stage A streams its
layers' experts the other card and its link idle. The helper lives on that idle stage B. It
holds no experts and no VRAM of its own: `bind_stage_helper` points it, per prompt, at B's lent
buffers (`Stage.lend()`: B's expert ring and expert workspace), and its temporaries come from
B's allocator under B's budget.

Per layer of A (shape legend: T tokens, A picks per token, D hidden, E experts, n = helper's):
1. A publishes the MoE input h [T, D] and the routing (experts, weights [T, A]) through mapped
   host memory (`Exchange`, copy_f32_wide); from them B builds its own row table and group
   bounds (the rows routed to its experts, sorted first) without a round trip.
2. B streams the layer's last n experts from A's pinned arena over B's own link into B's ring,
   two layers ahead, dequantizes them into B's workspace, computes its rows with the grouped
   GEMM, weights them and sends back their sum per token [T, D].
3. A computes the rows of its own E - n experts meanwhile and adds B's sums.
Events order every hand-over; the host never waits. Output is repeatable (fixed summation
order) and equals unhelped output within rounding (the two partial sums round separately).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.kernels.routing import group_rows, masked_combine
from strata_mgpu.split.exchange import Exchange
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.expert_ring import ExpertRing, LayerFeed
from strata_mgpu.stage.host_arena import HostExpertArena

MESSAGES_PER_LAYER = 3  # h, experts, weights


@dataclass(frozen=True)
class LentBuffers:
    """What an idle stage lends its helper for one prompt: VRAM laid out when the stage was built."""

    ctx: DeviceContext
    kernels: TorchKernels
    ring: ExpertRing
    w_gate_up: torch.Tensor  # [E, 2F, D]
    w_down: torch.Tensor  # [E, D, F]


class PeerPrefill:
    """The stream-only helper of one busy stage, living on another (idle) stage's device."""

    def __init__(self, to_helper: Exchange, from_helper: Exchange):
        self.to_helper = to_helper  # busy stage -> helper: h, experts, weights
        self.from_helper = from_helper  # helper -> busy stage: weighted sums per token
        self.lent: LentBuffers | None = None
        self.arena: HostExpertArena | None = None
        self.layers: range | None = None
        self.n_experts = 0  # the helper takes the last n experts of every layer
        self._feed: LayerFeed | None = None

    @property
    def bound(self) -> bool:
        return self.lent is not None and self.n_experts > 0

    def bind_stage_helper(self, lent: LentBuffers, arena: HostExpertArena, layers: range, n_experts: int) -> None:
        """For one prompt: help with the last `n_experts` of each of `layers` (the busy stage's),
        read from its `arena`, computed in `lent`."""
        assert 0 < n_experts < arena.spec.n_experts
        self.lent, self.arena, self.layers, self.n_experts = lent, arena, layers, n_experts
        self._feed = None

    def unbind(self) -> None:
        self.lent = self.arena = self.layers = self._feed = None
        self.n_experts = 0

    def split(self, layer: int) -> tuple[int, int]:
        """(the helper's first expert, the byte offset of its share in the arena layer)."""
        assert self.arena is not None
        first = self.arena.spec.n_experts - self.n_experts
        return first, first * self.arena.layouts[layer].expert_bytes

    def begin(self) -> None:
        """Queue the helper's uploads of the first layers, as the busy stage queues its own."""
        assert self.lent is not None and self.layers is not None
        self._feed = LayerFeed(self.lent.ring, len(self.layers), self._source)

    def _source(self, i: int) -> tuple[int, torch.Tensor]:
        assert self.arena is not None and self.layers is not None
        layer = self.layers[i]
        return layer, self.arena.layer(layer)[self.split(layer)[1]:]

    def publish(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> None:
        """On the busy stage's stream: the layer's MoE input and routing, to the helper."""
        self.to_helper.send(h)
        self.to_helper.send(experts)
        self.to_helper.send(weights)

    def run_layer(self, i: int, n_experts_total: int) -> None:
        """Queue the helper's work for local layer i on the helper's stream."""
        lent, arena, layers, feed = self.lent, self.arena, self.layers, self._feed
        assert lent is not None and arena is not None and layers is not None and feed is not None
        layer = layers[i]
        lay = arena.layouts[layer]
        first, _ = self.split(layer)
        n = self.n_experts
        with lent.ctx.on_compute(after_caller=False, join_caller=False):
            h = self.to_helper.receive()
            experts = self.to_helper.receive()
            weights = self.to_helper.receive()
            lent.ctx.access((lent.w_gate_up, lent.w_down), "w")
            lent.kernels.dequant_experts(feed.acquire(i), lay, n, lent.w_gate_up, lent.w_down)
            feed.release(i)
            local = (experts - first) % n_experts_total  # the helper's experts become 0..n-1, sorted first
            order, offs = group_rows(local, n_experts_total)
            lent.ctx.access((lent.w_gate_up, lent.w_down), "r")
            y = lent.kernels.grouped_mlp(h[order // experts.shape[1]], offs[:n], lent.w_gate_up[:n], lent.w_down[:n])
            self.from_helper.send(masked_combine(y, order, weights, local < n))

    def collect(self) -> torch.Tensor:
        """On the busy stage's stream: the helper's weighted sums for the layer [T, D]."""
        return self.from_helper.receive()
