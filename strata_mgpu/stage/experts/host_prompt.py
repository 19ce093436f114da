"""`HostPrefillHelper`: a few-row streamed prompt pass's experts shared with the host's cores through
the stage's hand-over, as a split's `PeerPrefill` shares them with another card.
"""

from __future__ import annotations

import torch

from strata_mgpu.stage.experts.handover import Handover
from strata_mgpu.stage.experts.parts import LayerPart


class HostPrefillHelper:
    """The `PrefillHelper` contract with the hand-over's mailbox and worker as the other device: a
    streamed prompt pass of at most the mailbox's rows gives the last `n_experts` streamed experts of
    each layer to the host's cores, which read them once from the pinned arena. `takes` sets the
    pass's share; the GPU waits for the host's sums at `collect`, after it queued its own part."""

    halves_from = 0  # one hand-over a layer

    def __init__(self, handover: Handover):
        self.handover = handover
        self.n_experts = 0  # this pass's share of each layer's streamed experts (`takes`)
        self._host_of: torch.Tensor | None = None  # [L, E] uint8: the host's experts of each local layer
        self._rows: list[int] = []  # hand-overs not yet collected: their rows

    @property
    def bound(self) -> bool:
        return self.n_experts > 0

    def takes(self, n_rows: int, streamed: int) -> bool:
        """Does a streamed pass of n_rows (`streamed` experts a layer) give the host a share? Sets it."""
        handover = self.handover
        if n_rows > handover.max_rows or streamed <= 0:
            self.n_experts = 0
        elif handover.auto is not None:
            self.n_experts = min(streamed, handover.auto.prompt_experts(streamed))
        else:
            self.n_experts = min(streamed, round(handover.share_value * streamed))
        return self.n_experts > 0

    def begin(self, parts: list[LayerPart]) -> None:
        n_experts = self.handover.arena.spec.n_experts
        host_of = torch.zeros(len(parts), n_experts, dtype=torch.uint8)
        for i, part in enumerate(parts):
            host_of[i, list(part.streamed)] = 1
        device = self.handover.cache.slot_of.device
        pinned = host_of if device.type == "cpu" else host_of.pin_memory()  # no host wait for the copy
        self._host_of = pinned.to(device, non_blocking=True)
        self._rows = []
        self.handover.wake()

    def hand_over(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  first: bool = True) -> None:
        assert self._host_of is not None, "begin() first"
        self.handover.send_prompt(i, h, weights, experts, self._host_of[i])
        self._rows.append(h.shape[0])

    def collect(self) -> torch.Tensor:
        rows = self._rows.pop(0)
        return self.handover.collect(rows, self.handover.arena.spec.hidden)

    def abort(self) -> None:
        """Drop the pending hand-overs' sums (a host still computing answers into the mailbox, which the
        next request overwrites)."""
        self._rows = []
        self._host_of = None
