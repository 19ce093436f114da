"""What the decoder needs of whatever computes a layer's routed experts: `ExpertBackend`.

Shape legend: T = token rows, D = hidden, A = experts used per token.

The decoder asks once per forward whether the pass streams whole layers and whether it runs in
two halves of rows, then begins it; each layer's rows go through `start` (queued, perhaps handed
to a helper) and `finish` (the helper's part added), which the layer loop calls at the next layer.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ExpertBackend(Protocol):
    def should_stream(self, n_rows: int) -> bool:
        """Would a forward of `n_rows` compute whole layers of experts, rather than gather only the
        experts its rows picked?"""
        ...

    def in_halves(self, n_rows: int) -> bool:
        """Should a streamed forward of `n_rows` run its layers in two halves of rows?"""
        ...

    def begin(self, n_rows: int, stream: bool) -> None:
        """A forward over `n_rows` rows starts; `stream`: it computes whole layers, so a streaming backend
        starts its uploads."""
        ...

    def start(self, layer: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              hq: torch.Tensor | None = None, first: bool = True) -> torch.Tensor:
        """Local layer `layer`'s experts for rows h [t, D] routed by weights [t, A] (fp32) and experts
        [t, A]: the weighted outputs [t, D], or this backend's part where a helper computes the rest.
        hq: h quantized for integer expert kernels, or None. `first`: the layer's first rows, which
        load its experts."""
        ...

    def finish(self, started: torch.Tensor) -> torch.Tensor:
        """The full weighted outputs [t, D] of a `start`, in the order the starts were made."""
        ...

    def abort(self) -> None:
        """A forward failed partway: give back what the pass held (ring slots, a helper's)."""
        ...
