"""A Stage: one device and a layer range, composed by `build.build_stage` of its parts.

- `ctx`: the device, its streams and VRAM budget; `plan`: what the budget holds, line by line;
- `model`: the decoder forward over the layers' dense weights (the embedding on the first stage,
  the head on the last), its expert backend `experts` (resident experts in place, the rest
  streamed from the pinned `arena`, or gathered; on a CPU stage with `cpu_experts`, every
  expert computed on the host's cores from the arena's bytes: `HostCoreExperts`);
- `kv`: its sequences' caches within the plan; `graphs`: its decode steps as CUDA graphs;
- `refill`: the expert cache following the routing at each sequence's first decode step.

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
from gguf.constants import GGMLQuantizationType

from strata_mgpu.config import HostShare
from strata_mgpu.env import EnvOptions
from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.model.decoder import Decoder, Segment
from strata_mgpu.model.kv_cache import PLAIN_KV, SequenceKV
from strata_mgpu.model.runner import prefill_last_logits, prefill_pack_logits
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.cache import RefillOnFirstStep
from strata_mgpu.stage.experts.host_cores import HostCoreExperts
from strata_mgpu.stage.experts.lending import LentBuffers, PrefillHelper
from strata_mgpu.stage.experts.streamed import StreamedExperts
from strata_mgpu.stage.graphs.replay import DecodeGraphs
from strata_mgpu.stage.host.arena import HostExpertArena
from strata_mgpu.stage.kv.allocator import StageKV
from strata_mgpu.stage.kv.blocks import StageBlocks
from strata_mgpu.stage.memory_plan import MemoryPlan

log = logging.getLogger("strata.stage")


@dataclass(frozen=True)
class StageOptions:
    device: torch.device
    max_vram_gib: float | None = None
    ring_slots: int = 2
    chunk_size: int = 8192  # the largest prefill chunk, for the activation line of the plan
    kv_tokens: int = 8192  # KV cells the engine may fill in VRAM, all sequences together (the plan's KV line)
    context: int | None = None  # the longest sequence; beyond kv_tokens its older KV lives in host RAM
    expert_cache: bool = True  # False: no resident experts at all (every pass streams everything)
    resident_experts: int | None = None  # force K resident experts a layer (0: residency off); None: the plan's
    prefer_cuda_kernels: bool = True
    dtype: torch.dtype | None = None  # compute dtype; None: bf16 on CUDA, fp32 on the CPU
    cuda_graphs: bool = True  # replay decode steps as captured graphs (one per batch size bucket) where possible
    graph_batch: int = 8  # the largest batch replayed as a graph (STRATA_DECODE_GRAPH_BATCH)
    kv_prefetch: bool = True  # spilled KV uploaded a layer ahead on a side stream (STRATA_KV_PREFETCH)
    kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV  # keys, values (--cache-type-k/-v)
    # a CPU stage computes its experts on the host's cores from the arena's GGUF bytes (ggml: no ring,
    # cache or fp32 workspace) rather than through the device path's twins; `threads` cores (None: all)
    cpu_experts: bool = False
    threads: int | None = None
    adapt_threads: bool = True  # ... fewer of them while other processes take the cores (STRATA_ADAPT_THREADS)
    # a GPU stage's decode: the share of missing experts its host's cores compute (`experts.handover`);
    # `fixed` also on a CPU stage's device-path twins (tests)
    host_share: HostShare = HostShare("off")
    host_prompt_help: bool = False  # ... and its few-row streamed prompt passes too (`HostPrefillHelper`)
    # a bf16 GPU stage with the CUDA kernels keeps its projections and head as the file's blocks where
    # dense_q8 takes their type (`kernels.dense.DeviceDense`); False: bf16 copies (STRATA_DENSE_BLOCKS)
    dense_blocks: bool = True

    @classmethod
    def from_env(cls, environment: EnvOptions, **fields: Any) -> StageOptions:
        """Options whose switches come from the environment (`env.read()`): what a tool that builds
        one stage itself uses, as `Placement.from_env` is for the CLI's commands."""
        return cls(graph_batch=environment.decode_graph_batch, kv_prefetch=environment.kv_prefetch,
                   dense_blocks=environment.dense_blocks, adapt_threads=environment.adapt_threads, **fields)


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
    """One device and a layer range (see the module docstring); a `ModelRunner` when the range is
    the whole model."""

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
    refill: RefillOnFirstStep
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
        """KV cells in VRAM for all sequences together (the engine admits within it)."""
        return self.kv.vram_cells

    @property
    def max_context(self) -> int:
        """The longest sequence the plan holds (in VRAM, or with its older KV in host RAM)."""
        return self.kv.max_context

    def kv_cells(self, tokens: int) -> int:
        return self.kv.cells(tokens)

    def new_sequence(self, max_length: int) -> SequenceKV:
        return self.kv.new_sequence(max_length)

    def kv_blocks(self, block_tokens: int) -> StageBlocks:
        return StageBlocks(self.ctx, self.spec, self.layers, block_tokens=block_tokens, format=self.kv.format)

    @torch.inference_mode()
    def prefill(self, kv: SequenceKV, tokens: torch.Tensor, whole_prompt: bool = False,
                want_logits: bool = True) -> torch.Tensor:
        with self.ctx.on_compute():
            return prefill_last_logits(self.model, kv, tokens)

    @torch.inference_mode()
    def prefill_many(self, kvs: Sequence[SequenceKV], chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        with self.ctx.on_compute():
            return prefill_pack_logits(self.model, kvs, chunks)

    @torch.inference_mode()
    def decode(self, kvs: Sequence[SequenceKV], tokens: torch.Tensor) -> torch.Tensor:
        """A CUDA graph replay per step where the batch allows it (`decode_rows`); otherwise eager."""
        with self.ctx.on_compute():
            self.refill_cache(kvs)
            return self.decode_rows(kvs, tokens.to(self.ctx.device))

    @torch.inference_mode()
    def warm_decode_graphs(self, context: int) -> list[int]:
        """Every batch bucket's decode graph captured before the first request
        (`DecodeGraphs.warm`), the expert cache's pick counts put back as they were after the
        captures' steps on the dummy sequence."""
        cache = self.experts.cache
        with self.ctx.on_compute():
            picks = cache.picks.clone() if cache is not None else None
            try:
                return self.graphs.warm(context, self.plan.kv_tokens)
            finally:
                if cache is not None and picks is not None:
                    cache.picks.copy_(picks)

    def silent_faults(self) -> int:
        """Hand-overs of decode's experts to the host's cores that failed without raising
        (`StreamedExperts.silent_faults`); 0 for experts computed on the host's cores in order."""
        return self.experts.silent_faults()

    # -- what a split drives ---------------------------------------------------------------------
    def refill_cache(self, kvs: Sequence[SequenceKV]) -> None:
        """The expert cache follows the routing seen so far, before these sequences' first decode
        step (`RefillOnFirstStep`)."""
        self.refill(kvs)

    def decode_rows(self, kvs: Sequence[SequenceKV], inp: torch.Tensor) -> torch.Tensor:
        """One decode step of `kvs` through this stage's layers, on the current stream: token ids
        inp [B] where the stage embeds (the first), else hidden rows [B, D]; -> logits [B, V] where
        it holds the head (the last), else hidden rows [B, D]. Replays the stage's CUDA graph for
        this batch where `graphs.serves` it; a spilled sequence's KV is assembled eagerly. Where the
        budget runs out in the step, the captured graphs' memory goes and the step runs once more,
        from the caches' lengths before it (a step cut short after they advanced would else be
        written one cell on; its KV cells are simply rewritten)."""
        lengths = [kv.length for kv in kvs]
        if self.experts.arm():  # a replayed graph's hand-overs find the host's worker polling
            self.graphs.drop()  # the hand-over was detached: captures with its kernels go
        try:
            return self._decode_rows(kvs, inp)
        except torch.OutOfMemoryError:
            if not self.graphs.captured:
                raise
            log.warning("out of memory in a decode step on %s: dropping the %d captured decode graphs and running "
                        "the step again", self.ctx.device, len(self.graphs.captured))
        # outside the except block: its traceback would keep the failed step's frames (a graph) alive
        for kv, n in zip(kvs, lengths, strict=True):
            kv.length = n
        self.graphs.drop()
        torch.cuda.empty_cache()
        return self._decode_rows(kvs, inp)

    def _decode_rows(self, kvs: Sequence[SequenceKV], inp: torch.Tensor) -> torch.Tensor:
        if self.graphs.serves(kvs):
            out = self.graphs.step(kvs, inp)
            if out is not None:
                return out
        x = self.model.embed(inp) if self.is_first else inp
        x = self.model.run(x, [Segment(i, i + 1, kv) for i, kv in enumerate(kvs)])
        return self.model.logits(x) if self.is_last else x

    def lend(self) -> LentBuffers:
        """The VRAM a helper may borrow while this stage idles: its expert ring and its experts'
        bf16 workspace, both laid out when the stage was built."""
        if not isinstance(self.experts, StreamedExperts):
            raise ValueError(f"the stage on {self.ctx.device} computes its experts on the host's cores: it has no "
                             f"ring or workspace to lend")
        return LentBuffers(workspace=self.experts.workspace, ring=self.experts.ring)

    def attach_helper(self, helper: PrefillHelper | None) -> None:
        """The helper that takes a share of this stage's streamed prompt passes while bound."""
        self.experts.attach_helper(helper)

