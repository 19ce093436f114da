"""An `ExpertBackend` that delegates to another and raises at one layer when armed: the tests'
way to make a forward fail partway (its clean-up, its retry)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from strata_mgpu.model.expert_backend import ExpertBackend


class FailingExperts:
    """`inner`'s experts, raising RuntimeError('injected failure') once at `fail_layer` (None:
    disarmed), after calling `on_failure` (what a test records of the moment)."""

    def __init__(self, inner: ExpertBackend, on_failure: Callable[[], None] = lambda: None):
        self.inner, self.on_failure = inner, on_failure
        self.fail_layer: int | None = None

    def should_stream(self, n_rows: int) -> bool:
        return self.inner.should_stream(n_rows)

    def in_halves(self, n_rows: int) -> bool:
        return self.inner.in_halves(n_rows)

    def begin(self, n_rows: int, stream: bool) -> None:
        self.inner.begin(n_rows, stream)

    def start(self, layer: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              hq: torch.Tensor | None = None, first: bool = True) -> torch.Tensor:
        if layer == self.fail_layer:
            self.fail_layer = None
            self.on_failure()
            raise RuntimeError("injected failure")
        return self.inner.start(layer, h, weights, experts, hq=hq, first=first)

    def finish(self, started: torch.Tensor) -> torch.Tensor:
        return self.inner.finish(started)

    def abort(self) -> None:
        self.inner.abort()
