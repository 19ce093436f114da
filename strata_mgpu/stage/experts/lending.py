"""What a stage shares with the helper of another stage's prompts: the buffers an idle stage lends
(`LentBuffers`), and the helper as the busy stage's expert backend drives it (`PrefillHelper`).
Both live here, below the split that implements the helper, so the stage and the split each
import them and neither imports the other.

Shape legend: t = token rows handed over, D = hidden, E = experts, A = picks per token,
F = expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.parts import ExpertWorkspace, LayerPart
from strata_mgpu.stage.experts.ring import ExpertRing


@dataclass(frozen=True)
class LentBuffers:
    """What an idle stage lends its helper for one prompt: VRAM laid out when the stage was built."""

    workspace: ExpertWorkspace  # its context, kernels and experts' bf16 workspace
    ring: ExpertRing | None  # None where the idle stage streams nothing (then it cannot help)

    @property
    def ctx(self) -> DeviceContext:
        return self.workspace.ctx


class PrefillHelper(Protocol):
    """Another device computing the last `n_experts` streamed experts of each of the busy stage's
    layers, for one prompt at a time. Every call is queued from the busy stage's stream; the
    hand-overs are ordered by events, the host never waits."""

    n_experts: int  # of each layer's streamed experts, the last this many are the helper's
    halves_from: int  # a helped pass of this many rows or more runs in two halves (0: never)

    @property
    def bound(self) -> bool:
        ...

    def begin(self, parts: list[LayerPart]) -> None:
        """The busy stage's pass starts: the helper's part of each local layer, to upload ahead."""
        ...

    def hand_over(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  first: bool = True) -> None:
        """Local layer i's h [t, D] and routing [t, A] to the helper, its work queued; `first`: the layer's
        first hand-over, which loads its experts."""
        ...

    def collect(self) -> torch.Tensor:
        """The helper's weighted sums [t, D] of the oldest uncollected hand-over."""
        ...

    def abort(self) -> None:
        """The busy stage's pass failed: give back what the helper holds, drop what is in flight."""
        ...
