"""Routed experts of a device stage: resident ones computed in place, the rest streamed from the
pinned host arena. The `ExpertBackend` of a stage.

Shape legend: T = token rows, D = hidden, E = experts, A = experts per token, M = T * A routed
rows, F = expert width.

Two ways through a layer, picked per forward by its row count (`stream_rows`):
- a prompt pass computes every expert of the layer once: resident ones in place, the others
  streamed through the ring a layer or more ahead. A helper takes the last of each layer's
  streamed experts; a helped pass of `halves_from` rows or more runs in two halves of rows.
- gather (decode, and prompts below the limit): only the experts the rows picked, each read where
  it lives, a VRAM slot or the mapped pinned arena (no host sync). Where every expert is resident
  the limit is the kernels' (`gather_pick_limit`); where some stream, the break-even of the measured
  rates at the cache's hit rate (`break_even.gather_rows`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from strata_mgpu.kernels.experts import CudaKernels, TorchKernels
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.break_even import PassRates, gather_rows
from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.experts.handover import Handover
from strata_mgpu.stage.experts.host_prompt import HostPrefillHelper
from strata_mgpu.stage.experts.lending import PrefillHelper
from strata_mgpu.stage.experts.parts import (
    ExpertWorkspace,
    LayerPart,
    PartTables,
    Routed,
    compute_part,
    load_part,
    part_rows,
    split_layer,
)
from strata_mgpu.stage.experts.ring import ExpertRing, LayerFeed
from strata_mgpu.stage.host.arena import HostExpertArena

log = logging.getLogger("strata.stage")

# Where every expert is resident, a pass of fewer picks than these gathers. A whole-layer pass
# first dequantizes all E experts and then runs the grouped GEMMs; a gathered pass computes only the
# picks, expert by expert (`kernels.moe_grouped`) or pick by pick (types without the grouped
# kernels). By the kernels alone (`tools.bench_kernels`) gathering wins up to about 1,024 picks of
# 30B-A3B expert by expert, 512 pick by pick. Past the limit the whole-layer pass takes the
# decoder's segment path, ~30 launches a layer and attention a segment at a time, where a gathered
# one takes the row path's fused ops (`Decoder._takes_static`), whose saved host time outweighs the
# grouped kernels' extra device time up to 1,536 picks (192 rows of 30B-A3B; docs/BENCHMARKS.md).
GATHER_PICKS_RESIDENT = 1536
GATHER_PICKS_BY_PICK = 512


def gather_pick_limit(n_experts: int, all_resident: bool, fused: bool, grouped: bool = False) -> int:
    """Picks (rows x experts a row) from which a pass computes whole layers. Where some experts
    stream: E, since a pass that touches most of them is cheaper streamed in order. Where every
    expert is resident and the fused kernels serve every layer (no workspace needed):
    GATHER_PICKS_RESIDENT where the grouped kernels serve every layer too, else GATHER_PICKS_BY_PICK."""
    if not (all_resident and fused):
        return n_experts
    return max(n_experts, GATHER_PICKS_RESIDENT if grouped else GATHER_PICKS_BY_PICK)


class StreamedExperts:
    """The `ExpertBackend` of a stage: experts from VRAM where resident, else from the host arena.
    Owns the bf16 workspace of one layer's experts."""

    def __init__(self, ctx: DeviceContext, spec: ModelSpec, arena: HostExpertArena, kernels: TorchKernels,
                 ring: ExpertRing | None, cache: ExpertCache | None, layers: range,
                 dtype: torch.dtype = torch.bfloat16):
        self.ctx, self.spec, self.arena, self.kernels, self.ring, self.cache = ctx, spec, arena, kernels, ring, cache
        self.layers = layers  # global layer ids, in order; start() gets the index into them
        E, F, D = spec.n_experts, spec.expert_ffn, spec.hidden
        # one layer's experts as bf16: the GEMMs' operands (E x 2F x D and E x D x F)
        self.workspace = ExpertWorkspace(
            ctx, kernels, ctx.label(torch.empty(E, 2 * F, D, dtype=dtype, device=ctx.device), "workspace gate-up"),
            ctx.label(torch.empty(E, D, F, dtype=dtype, device=ctx.device), "workspace down"))
        self._feed: LayerFeed | None = None  # this pass's uploads
        self._tables: PartTables | None = None
        self.streaming = False
        self.helper: PrefillHelper | None = None  # attached by a split (`attach_helper`)
        # the host's cores as a few-row prompt pass's helper where no split's helper is bound (`attach_handover`)
        self.host_helper: HostPrefillHelper | None = None
        self._active: PrefillHelper | None = None  # this pass's helper, if any (`begin`)
        # a share of a gathered pass's missing experts computed on the host's cores (`attach_handover`)
        self.handover: Handover | None = None
        self._closed_faults = 0  # silent failures of hand-overs detached since
        self._handing_over = False  # this pass hands picks over (`begin`: a hand-over that has not failed)
        plans = [kernels.moe_fused(arena.layouts[layer], D, spec.n_experts_used) if isinstance(kernels, CudaKernels)
                 else None for layer in layers]
        fused = dtype == torch.bfloat16 and all(plan is not None for plan in plans)
        grouped = fused and all(plan is not None and CudaKernels.grouped_serves(plan, D) for plan in plans)
        self._resident_picks = gather_pick_limit(E, cache is not None and cache.per_layer >= E, fused, grouped)
        # where some experts stream: the rows the gathered kernels take (the twins' workspace holds E experts)
        self._cap_rows = GATHER_PICKS_BY_PICK // spec.n_experts_used if fused else -(-E // spec.n_experts_used)
        self._expert_bytes = sum(arena.layouts[layer].expert_bytes for layer in layers) / max(1, len(layers))
        self.rates: PassRates | None = None  # set_gather_rule: the measured rates of the break-even
        self.floor_rows = 1
        self.fixed_rows: int | None = None

    def set_gather_rule(self, rates: PassRates | None, floor_rows: int, fixed_rows: int | None = None) -> None:
        """Where some experts stream, passes of fewer rows than the break-even of `rates` gather (None: E
        picks), never fewer than `floor_rows`; `fixed_rows`: that many instead (STRATA_GATHER_ROWS)."""
        self.rates, self.floor_rows, self.fixed_rows = rates, floor_rows, fixed_rows

    @property
    def partly_resident(self) -> bool:
        return self.cache is not None and self.cache.per_layer < self.spec.n_experts

    def stream_rows(self) -> int:
        """Rows from which a forward streams whole layers (0: every forward streams)."""
        if self.cache is None:
            return 0
        if not self.partly_resident:
            return -(-self._resident_picks // self.spec.n_experts_used)
        if self.fixed_rows is not None:
            return max(1, min(self.fixed_rows, self._cap_rows))
        return gather_rows(self.rates, n_experts=self.spec.n_experts, n_used=self.spec.n_experts_used,
                           missing=self.spec.n_experts - self.cache.per_layer, expert_bytes=self._expert_bytes,
                           miss_share=1.0 - self.cache.expected_hit, floor_rows=self.floor_rows,
                           cap_rows=self._cap_rows)

    @property
    def gather_picks(self) -> int:
        """Picks (rows x experts a row) from which a forward streams whole layers."""
        if not self.partly_resident:
            return self._resident_picks
        return self.stream_rows() * self.spec.n_experts_used

    def attach_handover(self, handover: Handover | None, prompts: bool = False) -> None:
        """Gathered passes of up to `handover.max_rows` rows hand a share of their missing experts to the
        host's cores, and with `prompts` streamed ones too; None: the GPU computes every pick."""
        self.handover = handover
        self.host_helper = HostPrefillHelper(handover) if handover is not None and prompts else None

    def silent_faults(self) -> int:
        """The hand-overs' failures that layers went on past, detached ones' included: the count only rises."""
        return self._closed_faults + (self.handover.silent_faults() if self.handover is not None else 0)

    def arm(self) -> bool:
        """Before a decode step: the hand-over's worker polls while it runs. True where the hand-over was
        detached just now: graphs captured with its kernels must go."""
        if self.handover is None or self.handover.arm():
            return False
        log.info("decode stops handing experts to the host's cores on %s", self.ctx.device)
        self.handover.set_share(0.0)  # the layers of steps in flight not yet sent give the host nothing
        self.ctx.synchronize_device()  # the steps in flight end, the worker answering what they sent
        self._closed_faults += self.handover.silent_faults()
        self.handover.close()
        self.handover = self.host_helper = None
        return True

    def attach_helper(self, helper: PrefillHelper | None) -> None:
        self.helper = helper

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.nbytes

    def resident(self, i: int) -> dict[int, int]:
        if self.cache is None:
            return {}
        row = self.cache.slot_of_host[i].numpy()  # one numpy pass, not a tensor op per expert (host time a prompt)
        held = np.flatnonzero(row >= 0)
        return dict(zip(held.tolist(), row[held].tolist(), strict=True))

    def streamed_per_layer(self) -> int:
        return self.spec.n_experts - (self.cache.per_layer if self.cache is not None else 0)

    def pass_bytes(self) -> int:
        return self.streamed_per_layer() * sum(self.arena.layouts[layer].expert_bytes for layer in self.layers)

    def should_stream(self, n_rows: int) -> bool:
        return self.cache is None or n_rows * self.spec.n_experts_used >= self.gather_picks

    @property
    def helped(self) -> bool:
        return self.streaming and self._active is not None

    @property
    def _helper_bound(self) -> bool:
        return self.helper is not None and self.helper.bound

    def begin(self, n_rows: int, stream: bool) -> None:
        self.streaming = stream
        self._feed = self._tables = self._active = None
        # a hand-over that has failed (the next decode step's arm detaches it) takes no pass: the
        # layers would go on without the host's part, and the fault count would not rise again
        self._handing_over = self.handover is not None and self.handover.silent_faults() == 0
        if self.streaming and self.cache is not None:
            self.cache.land()  # the experts moving into VRAM in the table: the ring holds only the rest
        if not self.streaming:
            if self.handover is not None:
                self.handover.wake()  # the worker polls (a decode step's arm, in Stage.decode_rows, counts it)
            return
        if self._helper_bound:
            self._active = self.helper
        elif (self.host_helper is not None and self._handing_over
              and self.host_helper.takes(n_rows, self.streamed_per_layer())):
            self._active = self.host_helper
        helper = self._active
        n_help = helper.n_experts if helper is not None else 0
        own: list[LayerPart] = []
        helped: list[LayerPart] = []
        for i, layer in enumerate(self.layers):
            mine, theirs = split_layer(layer, self.resident(i), self.spec.n_experts, n_help)
            own.append(mine)
            helped.append(theirs)
        self._feed = LayerFeed(self.ring, len(own), lambda i: (own[i].layer, own[i].runs(self.arena)))
        feed = self._feed
        self._tables = PartTables(own, self.arena, self.ctx.device,
                                  self.cache.slot if self.cache is not None else None,
                                  lambda i: feed.slot_of[i].buffer if i in feed.slot_of else None)
        if helper is not None:
            helper.begin(helped)

    def abort(self) -> None:
        """A forward failed partway: give back the ring this pass held, and the helper's, so the next
        prompt can stream."""
        if self._feed is not None:
            self._feed.abort()
        if self.helped and self._active is not None:
            self._active.abort()
        self._feed = self._tables = self._active = None

    def start(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              hq: torch.Tensor | None = None, first: bool = True) -> torch.Tensor:
        """Local layer i's rows, gathered or streamed, the helper's share handed over first (its sums come
        in `finish`). `first`: the layer's first rows, which load its experts."""
        layer = self.layers[i]
        lay = self.arena.layouts[layer]
        if self.cache is not None:
            self.cache.observe(i, experts)
        if not self.streaming:
            assert self.cache is not None
            ws = self.workspace
            self.ctx.access((ws.w_gate_up, ws.w_down), "w")
            handover = (self.handover if self.handover is not None and self._handing_over
                        and self.handover.takes(h.shape[0]) else None)
            if handover is None:
                return self.kernels.moe_gathered(self.cache, i, lay, h, weights, experts, ws.w_gate_up, ws.w_down,
                                                 hq=hq)
            own = handover.send(i, h, weights, experts)  # the host's picks -1: it computes them meanwhile
            return handover.add(self.kernels.moe_gathered(self.cache, i, lay, h, weights, own, ws.w_gate_up,
                                                          ws.w_down, hq=hq))
        if self.helped:
            return self._helped_rows(i, h, weights, experts, first)
        feed, tables = self._feed, self._tables
        assert feed is not None and tables is not None
        feed.acquire(i)
        return compute_part(self.workspace, tables, i, Routed(h, weights, experts), release=lambda: feed.release(i),
                            whole_layer=True)

    def in_halves(self, n_rows: int) -> bool:
        return self.helper is not None and self.helper.bound and 0 < self.helper.halves_from <= n_rows

    def _helped_rows(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, first: bool
                     ) -> torch.Tensor:
        """The helper handed its inputs first (it works while we do), then this stage's partial sums [t, D]."""
        helper = self._active
        assert self.helped and helper is not None
        helper.hand_over(i, h, weights, experts, first)
        feed, tables = self._feed, self._tables
        assert feed is not None and tables is not None
        if first:
            feed.acquire(i)
            load_part(self.workspace, tables, i, release=lambda: feed.release(i))
        return part_rows(self.workspace, tables, i, Routed(h, weights, experts), whole_layer=False)

    def finish(self, started: torch.Tensor) -> torch.Tensor:
        """A `start`'s outputs [t, D], the helper's sums added; they arrive in the order of the starts."""
        if self.helped and self._active is not None:
            return started + self._active.collect()
        return started
