"""PeerPrefill: the idle stage's card streams and computes a share of the busy stage's experts.

A prompt that fits one chunk runs the stages one after the other, so while stage A streams its
experts the other card and its link idle. The helper lives on that idle stage B, with no experts
or VRAM of its own: per prompt it uses B's lent ring and workspace, under B's budget.

Per layer of A (shape legend: T tokens, A picks per token, D hidden, E experts, n = helper's):
1. A hands over h [T, D] and the routing [T, A] through mapped host memory.
2. B streams its n experts (the last n A would stream: resident ones stay with A) from A's pinned
   arena over B's own link, two layers ahead, and sends back its rows' sum per token [T, D].
3. A computes its own experts' rows meanwhile and adds B's sums.
Events order every hand-over; the host never waits. Output is repeatable (fixed summation order)
and equals unhelped output within rounding. A prompt of `halves_from` tokens or more runs in two
halves of rows, so one half's round trip runs while A works on the other; off by default (where
the host's launches bind a helped layer, halves only add launches: docs/MULTI_GPU.md).
"""

from __future__ import annotations

import torch

from strata_mgpu.split.exchange import Exchange
from strata_mgpu.stage.experts.lending import LentBuffers
from strata_mgpu.stage.experts.parts import LayerPart, PartTables, Routed, load_part, part_rows
from strata_mgpu.stage.experts.ring import LayerFeed
from strata_mgpu.stage.host.arena import HostExpertArena

MESSAGES_PER_LAYER = 3  # h, experts, weights


class PeerPrefill:
    """The stream-only helper of one busy stage, living on another (idle) stage's device: the
    `PrefillHelper` a split binds to each busy stage."""

    def __init__(self, to_helper: Exchange, from_helper: Exchange, halves_from: int = 0):
        self.to_helper = to_helper  # busy stage -> helper: h, experts, weights
        self.from_helper = from_helper  # helper -> busy stage: weighted sums per token
        self.halves_from = halves_from  # a helped pass of this many rows runs them in two halves (0: never)
        self.lent: LentBuffers | None = None
        self.arena: HostExpertArena | None = None
        self.n_experts = 0  # the helper takes the last n streamed experts of every layer
        self._feed: LayerFeed | None = None
        self._tables: PartTables | None = None
        self.streamed_bytes = 0  # bytes its passes streamed over its link (what they were to upload)

    @property
    def bound(self) -> bool:
        return self.lent is not None and self.n_experts > 0

    def bind_stage_helper(self, lent: LentBuffers, arena: HostExpertArena, n_experts: int) -> None:
        """For one prompt: help with the last `n_experts` streamed experts of each of the busy stage's
        layers, read from its `arena`, computed in `lent`."""
        assert n_experts > 0 and lent.ring is not None
        assert n_experts * arena.max_expert_bytes <= lent.ring.slot_bytes, "the helper's share exceeds the lent ring"
        self.lent, self.arena, self.n_experts = lent, arena, n_experts
        self._feed = self._tables = None

    def abort(self) -> None:
        """The busy stage's pass failed: give the lent ring back, and drop the hand-overs sent but not
        received, or the next prompt would read them as its first layer's."""
        if self._feed is not None and self.lent is not None:
            with self.lent.ctx.on_compute(after_caller=False, join_caller=False):
                self._feed.abort()
        self._feed = self._tables = None
        self.to_helper.drop_pending()
        self.from_helper.drop_pending()

    def unbind(self) -> None:
        self.lent = self.arena = self._feed = self._tables = None
        self.n_experts = 0

    def begin(self, parts: list[LayerPart]) -> None:
        lent, arena = self.lent, self.arena
        assert lent is not None and arena is not None
        with lent.ctx.on_compute(after_caller=False, join_caller=False):
            feed = self._feed = LayerFeed(lent.ring, len(parts), lambda i: (parts[i].layer, parts[i].runs(arena)))
            self._tables = PartTables(parts, arena, lent.ctx.device, None,
                                      lambda i: feed.slot_of[i].buffer if i in feed.slot_of else None)
        self.streamed_bytes += feed.bytes

    def hand_over(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, first: bool = True
                  ) -> None:
        """`run_rows` queued on the helper's stream for these rows."""
        for x in (h, experts, weights):  # the order run_rows receives them in
            self.to_helper.send(x)
        self.run_rows(i, first)

    def run_rows(self, i: int, first: bool) -> None:
        lent, feed, tables = self.lent, self._feed, self._tables
        assert lent is not None and feed is not None and tables is not None
        with lent.ctx.on_compute(after_caller=False, join_caller=False):
            h, experts, weights = (self.to_helper.receive() for _ in range(MESSAGES_PER_LAYER))
            if first:
                feed.acquire(i)
                load_part(lent.workspace, tables, i, release=lambda: feed.release(i))
            y = part_rows(lent.workspace, tables, i, Routed(h, weights, experts), whole_layer=False)
            self.from_helper.send(y)

    def collect(self) -> torch.Tensor:
        return self.from_helper.receive()
