"""A Stage: one device and a layer range, composed by `build.build_stage` of its parts.

A stage holding every layer is the engine's `ModelRunner`; `--layer-split` chains several
(`split.runner`), each through `decode_rows` and its forward, its idle buffers lent to another
stage's helper (`lend`, `attach_helper`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from strata_mgpu.config import StageSwitches
from strata_mgpu.env import EnvOptions
from strata_mgpu.kernels.experts import CudaKernels, TorchKernels
from strata_mgpu.model.decoder import Decoder, Segment
from strata_mgpu.model.kv_pool import BlockTable
from strata_mgpu.model.linear_state import HybridSequence, LinearSnapshot
from strata_mgpu.model.runner import (
    RunnerSequence,
    dtype_name,
    mark_linear_states,
    prefill_last_logits,
    prefill_pack_logits,
    segment,
    taken_linear_states,
    with_linear_state,
)
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.host_cores import HostCoreExperts
from strata_mgpu.stage.experts.lending import LentBuffers, PrefillHelper
from strata_mgpu.stage.experts.residency import Residency
from strata_mgpu.stage.experts.streamed import StreamedExperts
from strata_mgpu.stage.graphs.replay import DecodeGraphs
from strata_mgpu.stage.host.arena import HostExpertArena
from strata_mgpu.stage.kv.allocator import StageKV
from strata_mgpu.stage.kv.pool import StagePool
from strata_mgpu.stage.memory_plan import GiB, MemoryPlan, vram_plan_line

log = logging.getLogger("strata.stage")


@dataclass(frozen=True)
class StageOptions:
    """One stage's options: its device, budget and share of the host's cores, and the switches every
    stage runs by (`config.StageSwitches`)."""

    device: torch.device
    switches: StageSwitches = StageSwitches()
    max_vram_gib: float | None = None
    chunk_size: int = 8192  # the largest prefill chunk, for the activation line of the plan
    kv_tokens: int = 8192  # KV cells the engine may fill in VRAM, all sequences together (the plan's KV line)
    context: int | None = None  # the longest sequence; beyond kv_tokens its older KV lives in host RAM
    sequences: int = 16  # the most running at once (the engine's --max-running): the plan's DeltaNet state line
    # a CPU stage computes its experts on the host's cores from the arena's GGUF bytes (ggml: no ring,
    # cache or fp32 workspace) rather than through the device path's twins; `threads` cores (None: all)
    host_core_experts: bool = False
    threads: int | None = None
    # what only tests and tools set
    ring_slots: int = 2
    expert_cache: bool = True  # False: no resident experts at all (every pass streams everything)
    prefer_cuda_kernels: bool = True
    dtype: torch.dtype | None = None  # the compute dtype, overriding the switches' (`compute_dtype`)

    @classmethod
    def from_env(cls, environment: EnvOptions, **fields: Any) -> StageOptions:
        """Options whose switches come from the environment (`env.read()`), for a tool that builds one stage."""
        return cls(switches=StageSwitches.from_env(environment), **fields)

    @property
    def compute_dtype(self) -> torch.dtype:
        """`dtype`, else bf16 on a GPU whose switches say bf16, else fp32."""
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if self.device.type == "cuda" and self.switches.dtype == "bf16" else torch.float32

    @property
    def max_vram_bytes(self) -> int | None:
        return int(self.max_vram_gib * GiB) if self.max_vram_gib else None


@dataclass
class StageReport:
    dense_bytes: int
    arena_bytes: int
    ring_bytes: int
    workspace_bytes: int
    cache_slots: int
    kernels: str
    plan: MemoryPlan
    pass_bytes: int  # expert bytes a prompt pass streams over the stage's link (the rest is resident)


@dataclass(eq=False)  # identity: stages are compared and hashed as the objects they are
class Stage:
    """One device and a layer range; a `ModelRunner` when the range is the whole model."""

    options: StageOptions
    spec: ModelSpec
    layers: range
    ctx: DeviceContext
    arena: HostExpertArena
    plan: MemoryPlan
    kernels: TorchKernels
    experts: StreamedExperts | HostCoreExperts
    model: Decoder  # its expert backend is `experts`
    kv: StageKV
    graphs: DecodeGraphs
    refill: Residency  # before each decode step: the resident experts follow the picks
    report: StageReport

    @property
    def is_first(self) -> bool:
        return self.layers.start == 0

    @property
    def is_last(self) -> bool:
        return self.layers.stop == self.spec.n_layers

    @property
    def stages(self) -> list[Stage]:
        return [self]

    # -- the ModelRunner contract ---------------------------------------------------------------
    @property
    def kv_token_budget(self) -> int:
        return self.kv.vram_cells

    @property
    def max_context(self) -> int:
        return self.kv.max_context

    def kv_pool(self, block_tokens: int, cells: int) -> StagePool:
        return self.kv.make_pool(block_tokens)

    def new_sequence(self, max_length: int, table: BlockTable | None = None, length: int = 0,
                     state: LinearSnapshot | None = None) -> RunnerSequence:
        """The sequence's KV of the stage's attention layers (`StageKV`); on a hybrid model with its
        linear layers' DeltaNet state on the stage's device beside it (`state`: the snapshot at `length`
        of a cached prefix, restored on the compute stream). A GPU stage keeps its snapshots in pinned host
        RAM: the prefix cache holds them, and the plan counts only the running sequences' states."""
        kv = self.kv.new_sequence(max_length, table, length)
        with self.ctx.on_compute():
            return with_linear_state(self.model, kv, length, state,
                                     snapshots_on=torch.device("cpu") if self.ctx.is_cuda else None)

    def mark_states(self, kv: RunnerSequence, boundaries: Sequence[int]) -> None:
        mark_linear_states(kv, boundaries)

    def taken_states(self, kv: RunnerSequence) -> dict[int, LinearSnapshot]:
        return taken_linear_states(kv)

    @torch.inference_mode()
    def prefill(self, kv: RunnerSequence, tokens: torch.Tensor, whole_prompt: bool = False,
                want_logits: bool = True) -> torch.Tensor:
        with self.ctx.on_compute():
            return prefill_last_logits(self.model, kv, tokens)

    @torch.inference_mode()
    def prefill_many(self, kvs: Sequence[RunnerSequence], chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        with self.ctx.on_compute():
            return prefill_pack_logits(self.model, kvs, chunks)

    @torch.inference_mode()
    def decode(self, kvs: Sequence[RunnerSequence], tokens: torch.Tensor) -> torch.Tensor:
        with self.ctx.on_compute():
            self.refill_cache(kvs)
            return self.decode_rows(kvs, tokens.to(self.ctx.device))

    @torch.inference_mode()
    def warm_decode_graphs(self, context: int) -> list[int]:
        """Every batch bucket's decode graph captured before the first request (on a GPU the two prompt
        paths run once first, `warm_prompts`), the expert cache's pick counts put back as they were
        before the dummy passes."""
        cache = self.experts.cache
        with self.ctx.on_compute():
            picks = cache.picks.clone() if cache is not None else None
            try:
                if self.ctx.is_cuda:
                    self.warm_prompts()
                return self.graphs.warm(context, self.plan.kv_tokens)
            finally:
                if cache is not None and picks is not None:
                    cache.picks.copy_(picks)

    @torch.inference_mode()
    def warm_prompts(self) -> list[int]:
        """A prompt of the most rows that gather and one of the fewest that stream, on a dummy sequence,
        so that what a path does once (cuBLAS's first GEMMs of a prompt's rows, a first pass through the
        ring) is not a first request's. The row counts run; the caller keeps the pick counts."""
        if not isinstance(self.experts, StreamedExperts):
            return []
        limit = self.experts.stream_rows()
        rows = sorted({max(1, limit - 1), max(1, limit)})
        g = torch.Generator().manual_seed(0)
        with self.ctx.on_compute():
            for n in rows:
                kv = self.model.new_cache(n, capacity=n)
                linear = self.model.new_linear_state()  # a hybrid model's DeltaNet state, else None
                if self.is_first:
                    x = self.model.embed(torch.randint(0, self.spec.vocab_size, (n,), generator=g).to(self.ctx.device))
                else:
                    x = torch.randn(n, self.spec.hidden, generator=g).to(self.model.w.dtype).to(self.ctx.device)
                self.model.run(x, [Segment(0, n, kv, linear)])
        return rows

    def silent_faults(self) -> int:
        return self.experts.silent_faults()

    def describe(self, with_layers: bool = False) -> str:
        kernels = self.kernels
        if isinstance(kernels, CudaKernels):
            path = "CUDA kernels (CuPy/NVRTC" + (", grouped GEMM by torch._grouped_mm)" if kernels.use_grouped_mm
                                                 else ", grouped GEMM expert by expert)")
        elif self.ctx.is_cuda:
            path = "the torch twins of the CUDA kernels (no CuPy: slower; pip install 'strata-mgpu[cuda12]')"
        else:
            path = "plain torch ops"
            if isinstance(self.experts, HostCoreExperts):
                path += f", experts from their GGUF bytes by {self.experts.executor.describe()}"
        where = f"layers {self.layers.start}-{self.layers.stop - 1} on " if with_layers else ""
        line = f"{where}{self.ctx.device} in {dtype_name(self.model.w.dtype)} with {path}"
        return line + ("; " + vram_plan_line(self.plan, self.report.pass_bytes) if self.ctx.is_cuda else "")

    # -- what a split drives ---------------------------------------------------------------------
    def refill_cache(self, kvs: Sequence[RunnerSequence]) -> None:
        self.refill(kvs)

    def decode_rows(self, kvs: Sequence[RunnerSequence], inp: torch.Tensor) -> torch.Tensor:
        """One decode step of `kvs` on the current stream (inputs and outputs as `Decoder.step_static`'s),
        a graph replay where `graphs.serves` the batch. Where the budget runs out in the step, the graphs'
        memory goes and the step runs again from the caches' lengths before it; a hybrid model's step
        cannot (its DeltaNet states, updated in place layer by layer, may have advanced), so there the
        out-of-memory error goes to the caller once the graphs are dropped (the engine ends the step's
        requests with 503, as any failed call's)."""
        lengths = [kv.length for kv in kvs]
        hybrid = any(isinstance(kv, HybridSequence) for kv in kvs)
        if self.experts.arm():  # a replayed graph's hand-overs find the host's worker polling
            self.graphs.drop()  # the hand-over was detached: captures with its kernels go
        try:
            return self._decode_rows(kvs, inp)
        except torch.OutOfMemoryError:
            if not self.graphs.captured:
                raise
            log.warning("out of memory in a decode step on %s: dropping the %d captured decode graphs and %s",
                        self.ctx.device, len(self.graphs.captured),
                        "ending the step's requests (their DeltaNet states may have advanced)" if hybrid
                        else "running the step again")
        # outside the except block: its traceback would keep the failed step's frames (a graph) alive
        self.graphs.drop()
        torch.cuda.empty_cache()
        if hybrid:
            raise torch.OutOfMemoryError(f"out of memory in a decode step of a hybrid model on {self.ctx.device}: "
                                         f"its DeltaNet states may have advanced, so the step is not run again")
        for kv, n in zip(kvs, lengths, strict=True):
            assert not isinstance(kv, HybridSequence)
            kv.length = n
        return self._decode_rows(kvs, inp)

    def _decode_rows(self, kvs: Sequence[RunnerSequence], inp: torch.Tensor) -> torch.Tensor:
        caches = [kv.kv if isinstance(kv, HybridSequence) else kv for kv in kvs]
        linear = [kv.linear for kv in kvs if isinstance(kv, HybridSequence)] or None
        if self.graphs.serves(caches, linear):
            out = self.graphs.step(caches, inp, linear)
            if out is not None:
                return out
        x = self.model.embed(inp) if self.is_first else inp
        x = self.model.run(x, [segment(i, i + 1, kv) for i, kv in enumerate(kvs)])
        return self.model.logits(x) if self.is_last else x

    def lend(self) -> LentBuffers:
        """The VRAM a helper may borrow while this stage idles: its expert ring and bf16 workspace."""
        if not isinstance(self.experts, StreamedExperts):
            raise ValueError(f"the stage on {self.ctx.device} computes its experts on the host's cores: it has no "
                             f"ring or workspace to lend")
        return LentBuffers(workspace=self.experts.workspace, ring=self.experts.ring)

    def attach_helper(self, helper: PrefillHelper | None) -> None:
        self.experts.attach_helper(helper)

