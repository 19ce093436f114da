"""Routed experts of a CPU stage: every layer's experts computed on the host's cores straight from
their GGUF bytes in the host arena (`kernels.cpu_experts`: ggml, or its torch twin where
ggml-python is missing).

Shape legend: T = token rows, D = hidden, A = experts per token.

Nothing is copied, streamed or dequantized ahead: no ring, no expert cache, no workspace. A
prompt and a decode step take the same path (`should_stream` is always False).
"""

from __future__ import annotations

import torch

from strata_mgpu.kernels.cpu_experts import CpuExperts
from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.model.decoder import DenseMatmul
from strata_mgpu.model.weights import BlockMatrix, Matrix
from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.experts.lending import PrefillHelper
from strata_mgpu.stage.experts.ring import ExpertRing
from strata_mgpu.stage.host.arena import HostExpertArena


class HostCoreExperts:
    """The `ExpertBackend` of a CPU stage whose experts run on the host's cores. It has what a stage's
    tools read of `StreamedExperts` but lends nothing to a helper."""

    cache: ExpertCache | None = None
    ring: ExpertRing | None = None
    helper: PrefillHelper | None = None
    workspace_bytes = 0

    def __init__(self, arena: HostExpertArena, executor: CpuExperts, kernels: TorchKernels, layers: range):
        self.arena, self.executor, self.kernels = arena, executor, kernels
        self.layers = layers  # global layer ids, in order; start() gets the index into them

    def should_stream(self, n_rows: int) -> bool:
        return False

    def in_halves(self, n_rows: int) -> bool:
        return False

    def begin(self, n_rows: int, stream: bool) -> None:
        assert not stream, "host-core experts never stream"

    def silent_faults(self) -> int:
        return 0  # computed in the step's own thread: a failure raises

    def arm(self) -> bool:
        """Nothing to wake: the experts run in the step's own thread."""
        return False

    def start(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              hq: torch.Tensor | None = None, first: bool = True) -> torch.Tensor:
        """Local layer i's rows h [T, D] -> their picks' weighted sum [T, D] in h's dtype (hq unused: the
        executor quantizes as ggml does)."""
        layer = self.layers[i]
        self.kernels.paths.ran("cpu_experts", self.executor.name)
        out = self.executor.moe(self.arena.layer(layer), self.arena.layouts[layer], h, weights, experts)
        return out if out.dtype == h.dtype else out.to(h.dtype)

    def finish(self, started: torch.Tensor) -> torch.Tensor:
        return started

    def abort(self) -> None:
        pass

    def attach_helper(self, helper: PrefillHelper | None) -> None:
        """Nothing streams, so there is nothing to help: only None is taken."""
        if helper is not None:
            raise ValueError("a stage whose experts run on the host's cores streams nothing: it takes no helper")

    def pass_bytes(self) -> int:
        return 0

    def streamed_per_layer(self) -> int:
        return 0


class HostDense(DenseMatmul):
    """A CPU stage's `DenseMatmul`: projections kept as blocks multiplied from their bytes by the
    executor that computes the stage's experts (a test that swaps it swaps both); float ones by torch."""

    def __init__(self, experts: HostCoreExperts):
        self.experts = experts

    def __call__(self, x: torch.Tensor, w: Matrix) -> torch.Tensor:
        if not isinstance(w, BlockMatrix):
            return x @ w.T
        out = self.experts.executor.matmul(x, w.raw, w.ggml_type, w.k)
        return out if out.dtype == x.dtype else out.to(x.dtype)
