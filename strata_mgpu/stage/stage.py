"""A Stage: one device, a layer range, dense weights resident, routed experts streamed.

Owns its device context (and compute stream), the dense weights of its layers (bf16 in VRAM;
the embedding on the first stage, the head on the last), the host expert arena of its layers
(pinned), its expert ring and expert cache, its KV caches, and the decoder forward over them.
One stage holding every layer is a `ModelRunner` itself; `--layer-split` chains several
(`runtime.split`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata_mgpu.kernels.decode_ops import ATTN_HEAD_DIMS, ATTN_MIN_CAPABILITY, CudaDecodeOps
from strata_mgpu.kernels.experts import CudaKernels, TorchKernels, select_kernels
from strata_mgpu.model.decoder import Decoder, Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_cache import KVCache
from strata_mgpu.model.runner import DecoderRunner
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.weights import load_weights
from strata_mgpu.stage.decode_graph import DecodeGraph, GraphCapture, bucket_for
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.expert_cache import ExpertCache
from strata_mgpu.stage.expert_ring import ExpertRing
from strata_mgpu.stage.host_arena import HostExpertArena
from strata_mgpu.stage.host_kv import KVStaging, TwoTierKV, make_kv_cache
from strata_mgpu.stage.memory_plan import MemoryPlan, plan_stage_memory
from strata_mgpu.stage.streamed_experts import StreamedExperts

log = logging.getLogger("strata.stage")
# cells a decode graph covers at least, where its caches hold that many (a sequence past them
# recaptures its batch's graph, at twice as many): more would make every step's attention launch
# blocks for cells no short sequence has
WARM_GRAPH_CELLS = 4096
# steps a batch size decodes eagerly after its capture ran out of memory, before capturing again
# (each try costs a warm-up step, a device sync and an empty_cache)
CAPTURE_RETRY_STEPS = 256
GiB = 2**30


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


@dataclass(frozen=True)
class LentBuffers:
    """What an idle stage lends its helper for one prompt: VRAM laid out when the stage was built."""

    ctx: DeviceContext
    kernels: TorchKernels
    ring: ExpertRing | None  # None where the idle stage streams nothing (then it cannot help)
    w_gate_up: torch.Tensor  # [E, 2F, D]
    w_down: torch.Tensor  # [E, D, F]


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


class Stage(DecoderRunner):
    """One device and a layer range; a `ModelRunner` when the range is the whole model."""

    def __init__(self, f: GGUFFile, spec: ModelSpec, opts: StageOptions, layers: range | None = None,
                 on_progress: Callable[[str, int, int], None] | None = None):
        layers = layers if layers is not None else range(spec.n_layers)
        self.options = opts
        assert 0 <= layers.start < layers.stop <= spec.n_layers and layers.step == 1
        self.layers = layers
        self.is_first, self.is_last = layers.start == 0, layers.stop == spec.n_layers
        self.ctx = DeviceContext(opts.device, int(opts.max_vram_gib * GiB) if opts.max_vram_gib else None)
        dtype = opts.dtype or (torch.bfloat16 if self.ctx.is_cuda else torch.float32)

        def progress(what: str, total: int) -> Callable[[int], None]:
            # on_layer gets the global layer id: count from this stage's first layer
            return (lambda i: on_progress(what, i - layers.start + 1, total)) if on_progress else (lambda i: None)

        tag = "" if self.is_first and self.is_last else f" {layers.start}-{layers.stop - 1} on {self.ctx.device}"
        dense = load_weights(f, spec, dtype=dtype, device=self.ctx.device, with_experts=False, layers=layers,
                             embed=self.is_first, head=self.is_last,
                             on_layer=progress("dense weights" + tag, len(layers)))
        # bytes of every storage once (wq/wk/wv are views of wqkv; a tied head is the embedding)
        tensors = [t for lw in dense.layers for t in vars(lw).values() if isinstance(t, torch.Tensor)]
        tensors += [x for x in (dense.embed, dense.output, dense.out_norm) if x is not None]
        dense_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
        self.arena = HostExpertArena(f, spec, layers, pin=self.ctx.is_cuda,
                                     on_layer=progress("experts" + tag, len(layers)))
        kernels = self.kernels = select_kernels(self.ctx.device, prefer_cuda=opts.prefer_cuda_kernels)
        self._graph_batch = opts.graph_batch  # the plan keeps its graphs' room
        self.plan = self._plan(spec, opts, layers, dense_bytes, dtype)
        self.plan_context = max(opts.context or 0, self.plan.kv_tokens)  # the longest sequence planned for
        ring = ExpertRing(self.ctx, self.plan.ring_slot_bytes, opts.ring_slots) if self.plan.ring else None
        cache = (ExpertCache(self.ctx, self.arena, layers, self.plan.resident_per_layer * len(layers))
                 if opts.expert_cache else None)
        experts = StreamedExperts(self.ctx, spec, self.arena, kernels, ring, cache, layers, dtype=dtype)
        fused_ops = isinstance(kernels, CudaKernels) and dtype == torch.bfloat16
        ops = CudaDecodeOps(self.ctx.device, paths=kernels.paths) if fused_ops else None  # one counter for both
        # Short prompts, packed prompts and eager decode batches through the decode step's fused
        # ops (`Decoder.static_rows`): the host's launches, not the GPU, bind a short prompt on the
        # segment path (docs/ARCHITECTURE.md). Only where their attention runs fused: its twin
        # costs a dozen launches a row.
        super().__init__(Decoder(spec, dense, experts, ops, static_rows=fused_ops and self._attention_fused(spec)))
        self._graphs_ok = (opts.cuda_graphs and cache is not None
                           and dtype == torch.bfloat16 and self._decode_never_syncs(kernels, spec))
        self._graphs: dict[int, DecodeGraph] = {}  # graph rows (`_graph_bucket`) -> its capture
        self._pad_kv: KVCache | None = None  # the dummy sequence padding a batch to its bucket
        self._capture: GraphCapture | None = None  # the stream and pool the graphs share (at the first capture)
        # bucket -> decode steps until its capture is tried again, after one ran out of memory
        self._capture_failed: dict[int, int] = {}
        # KV cells in VRAM for all sequences together (the engine admits within it); a sequence
        # longer than that keeps its older cells in pinned host RAM (`stage.host_kv`)
        self.kv_token_budget = self.plan.kv_tokens
        self._kv_prefetch = opts.kv_prefetch
        self._kv_staging: KVStaging | None = None
        self._decoding: weakref.WeakSet = weakref.WeakSet()  # sequences past their first decode step
        self.report = StageReport(dense_bytes=dense_bytes, arena_bytes=self.arena.nbytes,
                                  ring_bytes=ring.nbytes if ring else 0, workspace_bytes=experts.workspace_bytes,
                                  cache_slots=cache.n_slots if cache else 0,
                                  kernels=kernels.name + ("+grouped_mm" if getattr(kernels, "use_grouped_mm", False)
                                                          else ""),
                                  plan=self.plan, pass_bytes=experts.pass_bytes())
        log.info("stage on %s: experts %.2f GB pinned, %d/%d a layer resident, a prompt pass streams %.2f GB, "
                 "kernels %s", self.ctx.device, self.arena.nbytes / 1e9, self.plan.resident_per_layer,
                 spec.n_experts, self.report.pass_bytes / 1e9, self.report.kernels)
        log.info("memory plan of %s: %s", self.ctx.device, self.plan.describe())

    def _plan(self, spec: ModelSpec, opts: StageOptions, layers: range, dense_bytes: int,
              dtype: torch.dtype) -> MemoryPlan:
        """The stage's VRAM plan (`memory_plan`): on CUDA within the budget and what the card has
        free; on the CPU uncapped, with a quarter of each layer resident unless forced. Where the
        budget cannot hold the KV of the whole context, the VRAM KV is halved (down to one chunk)
        and longer sequences keep their older cells in host RAM."""
        budget = None
        if self.ctx.is_cuda:  # what may still be allocated, plus the dense weights already placed
            budget = self.ctx.vram_free_in_budget() + torch.cuda.memory_reserved(self.ctx.device)
            budget = min(budget, self.ctx.max_vram_bytes) if self.ctx.max_vram_bytes else budget
        resident = opts.resident_experts if opts.expert_cache else 0

        def halved(had: int, now: int) -> None:
            log.warning("stage on %s: the budget cannot hold %d tokens of KV in VRAM; trying %d, with longer "
                        "sequences' older KV in host RAM", self.ctx.device, had, now)

        return plan_stage_memory(spec, kv_tokens=opts.kv_tokens, context=opts.context or opts.kv_tokens,
                                 chunk_tokens=opts.chunk_size, on_halved=halved, n_layers=len(layers),
                                 expert_bytes=self.arena.max_expert_bytes, dense=dense_bytes, budget=budget,
                                 ring_slots=opts.ring_slots, elem=torch.empty((), dtype=dtype).element_size(),
                                 resident_per_layer=resident, where=f"stage on {self.ctx.device}",
                                 staging_buffers=2 if opts.kv_prefetch else 1,
                                 decode_rows=self._graph_batch, head=self.is_last)

    @property
    def max_context(self) -> int:
        """The longest sequence the plan holds (in VRAM, or with its older KV in host RAM through
        the planned staging buffer)."""
        return self.plan_context

    def kv_cells(self, tokens: int) -> int:
        """VRAM KV cells a sequence of `tokens` takes (the rest of a longer one lives in host RAM)."""
        return min(tokens, self.plan.kv_tokens)

    def new_sequence(self, max_length: int) -> KVCache | TwoTierKV:
        """A sequence's KV: all in VRAM when it fits the plan's KV cells, else the last cells in
        VRAM and the older ones in pinned host RAM (zero-filled on the stage's stream)."""
        with self.ctx.on_compute():
            staging = None
            if max_length > self.plan_context:
                raise ValueError(f"a sequence of {max_length} tokens exceeds the {self.plan_context} this stage "
                                 f"planned its KV for")
            if max_length > self.plan.kv_tokens:
                if self._kv_staging is None:  # one buffer for the planned context, as the plan counted it
                    self._kv_staging = KVStaging.for_model(self.spec, self.plan_context, ctx=self.ctx,
                                                           dtype=self.model.w.dtype, prefetch=self._kv_prefetch)
                staging = self._kv_staging
            return make_kv_cache(self.spec, self.layers, self.plan.kv_tokens, max_length, device=self.ctx.device,
                                 dtype=self.model.w.dtype, staging=staging)

    @property
    def stages(self) -> list[Stage]:
        return [self]

    def lend(self) -> LentBuffers:
        """The VRAM a helper may borrow while this stage idles: its expert ring and its experts'
        bf16 workspace, both laid out when the stage was built."""
        experts = self.model.experts
        return LentBuffers(ctx=self.ctx, kernels=self.kernels, ring=experts.ring, w_gate_up=experts.w_gate_up,
                           w_down=experts.w_down)

    def prefill(self, kv, tokens: torch.Tensor, whole_prompt: bool = False, want_logits: bool = True) -> torch.Tensor:
        with self.ctx.on_compute():
            return super().prefill(kv, tokens)

    def prefill_many(self, kvs, chunks) -> torch.Tensor:
        with self.ctx.on_compute():
            return super().prefill_many(kvs, chunks)

    def refill_cache(self, kvs) -> None:
        """Before a sequence's first decode step: follow the routing seen so far, its own prompt's
        included. Not before the prompt: there the moves would share the link with the prefill's
        stream (12% slower prompts, seen on the H200). One host sync, where the engine waits for the
        prompt's logits anyway; the copies run on the compute stream, ahead of the step."""
        cache = self.model.experts.cache
        new = [kv for kv in kvs if kv not in self._decoding]
        if cache is not None and new:
            cache.refill()
        self._decoding.update(new)

    @torch.inference_mode()
    def decode(self, kvs, tokens: torch.Tensor) -> torch.Tensor:
        """A CUDA graph replay per step on the capturable path (`decode_rows`); otherwise eager."""
        with self.ctx.on_compute():
            self.refill_cache(kvs)
            return self.decode_rows(kvs, tokens.to(self.ctx.device))

    def decode_rows(self, kvs, inp: torch.Tensor) -> torch.Tensor:
        """One decode step of `kvs` through this stage's layers, on the current stream: token ids
        inp [B] where the stage embeds (the first), else hidden rows [B, D]; -> logits [B, V] where
        it holds the head (the last), else hidden rows [B, D]. Replays the stage's CUDA graph for
        this batch where the path allows (every cache in VRAM, and too few rows to make the experts
        stream); a spilled sequence's KV is assembled eagerly. Where the budget runs out in the
        step, the captured graphs' memory goes and the step runs once more, from the caches'
        lengths before it (a step cut short after they advanced would else be written one cell on;
        its KV cells are simply rewritten)."""
        lengths = [kv.length for kv in kvs]
        try:
            return self._decode_rows(kvs, inp)
        except torch.OutOfMemoryError:
            if not self._graphs:
                raise
            log.warning("out of memory in a decode step on %s: dropping the %d captured decode graphs and running "
                        "the step again", self.ctx.device, len(self._graphs))
        # outside the except block: its traceback would keep the failed step's frames (a graph) alive
        for kv, n in zip(kvs, lengths, strict=True):
            kv.length = n
        self._graphs.clear()
        self._capture_failed.clear()
        torch.cuda.empty_cache()
        return self._decode_rows(kvs, inp)

    def _decode_rows(self, kvs, inp: torch.Tensor) -> torch.Tensor:
        if (self._graphs_ok and len(kvs) <= self._graph_batch and all(kv.graph_capturable for kv in kvs)
                and not self.model.experts.should_stream(self._graph_bucket(len(kvs)))):
            out = self._graph_step(kvs, inp)
            if out is not None:
                return out
        x = self.model.embed(inp) if self.is_first else inp
        x = self.model.run(x, [Segment(i, i + 1, kv) for i, kv in enumerate(kvs)])
        return self.model.logits(x) if self.is_last else x

    @torch.inference_mode()
    def warm_decode_graphs(self, context: int) -> list[int]:
        """Capture this stage's decode graphs before the first request, one for each batch size it
        replays, covering min(context, WARM_GRAPH_CELLS) cells: otherwise the first batch
        of each size waits for its capture (a warm-up step, then every launch of the step recorded)
        inside its first token's time. The captures' own steps run on the dummy sequence; the
        expert cache's pick counts are put back as they were. Returns the sizes captured; a size
        whose capture fails is left to its first use."""
        if not self._graphs_ok:
            return []
        sizes = sorted({self._graph_bucket(n) for n in range(1, self._graph_batch + 1)})
        sizes = [b for b in sizes if not self.model.experts.should_stream(b)]
        cells = min(context, self.plan.kv_tokens, WARM_GRAPH_CELLS)
        cache = self.model.experts.cache
        done = []
        with self.ctx.on_compute():
            pad = self._pad()
            picks = cache.picks.clone() if cache is not None else None
            try:
                for b in sizes:
                    inp = (torch.zeros(b, dtype=torch.long, device=self.ctx.device) if self.is_first else
                           torch.zeros(b, self.spec.hidden, dtype=self.model.w.dtype, device=self.ctx.device))
                    try:
                        graph = DecodeGraph(self.model, [pad] * b, inp, b, pad, cells,
                                            capture=self._graph_capture())
                    except RuntimeError as e:
                        log.warning("capturing the decode graph of %d rows on %s ahead of time failed (%s): left to "
                                    "its first use", b, self.ctx.device, e)
                        break
                    if graph.only is not None:  # an op ran its twin: the graph serves the dummy batch alone
                        break
                    self._graphs[b] = graph
                    done.append(b)
            finally:
                if picks is not None:
                    cache.picks.copy_(picks)
        return done

    def _pad(self) -> KVCache:
        """The dummy sequence padding a batch to its graph's rows (made at its first use)."""
        if self._pad_kv is None:
            self._pad_kv = self.model.new_cache(1, capacity=1)
        return self._pad_kv

    def _graph_capture(self) -> GraphCapture:
        if self._capture is None:
            self._capture = GraphCapture(self.ctx.device)
        elif not self._graphs:
            # a pool whose every graph is gone may not be captured into again (torch frees it at the
            # next empty_cache only if all its blocks are free): a new one, on the same stream
            self._capture.pool = torch.cuda.graph_pool_handle()
        return self._capture

    def _graph_bucket(self, rows: int) -> int:
        """The graph size serving `rows` rows. Pad rows pick experts as real rows do: only where
        every expert is resident do they cost no reads over the link (and no skew in the cache's
        pick counts), so elsewhere each batch size gets its own graph."""
        return bucket_for(rows, self._graph_batch, pad=self.plan.resident_share >= 1)

    def _graph_step(self, kvs, inp: torch.Tensor) -> torch.Tensor | None:
        """The step as a replay of its bucket's graph (captured at the bucket's first use, and
        again when a sequence grows past the cells it covers); None where capture fails."""
        for kv in kvs:
            kv.reserve(1)
        bucket = self._graph_bucket(len(kvs))
        graph = self._graphs.get(bucket)
        if graph is None or not graph.fits(kvs):
            self._graphs.pop(bucket, None)
            graph = None  # the old capture's memory goes before a new one is made
            if self._capture_failed.get(bucket, 0) > 0:  # out of memory lately: eager, no capture tried
                self._capture_failed[bucket] -= 1
                return None
            try:
                # at least as many cells as a graph captured ahead covers: no recapture below that
                cells = min(WARM_GRAPH_CELLS, max(kv.capacity for kv in kvs))
                graph = self._graphs[bucket] = DecodeGraph(self.model, kvs, inp, bucket, self._pad(), cells,
                                                           capture=self._graph_capture())
            except torch.OutOfMemoryError:  # no room for this capture now: eager for a while
                self._capture_failed[bucket] = CAPTURE_RETRY_STEPS
                log.warning("no memory to capture a decode graph of %d rows on %s: such batches decode eagerly for "
                            "the next %d steps", bucket, self.ctx.device, CAPTURE_RETRY_STEPS)
                return None
            except RuntimeError as e:  # a capture this torch cannot make: no graphs this large from now on
                if bucket > 1:  # the smaller sizes keep theirs
                    self._graph_batch = max(1, bucket - 1 if bucket & (bucket - 1) else bucket // 2)
                    log.warning("CUDA graph capture of a batch of %d failed on %s (%s): batches above %d decode "
                                "without graphs", bucket, self.ctx.device, e, self._graph_batch)
                    self._graphs = {b: g for b, g in self._graphs.items() if b <= self._graph_batch}
                else:
                    log.warning("CUDA graph capture failed on %s (%s): decoding without graphs", self.ctx.device, e)
                    self._graphs_ok = False
                    self._graphs = {}
                return None
        return graph.step(kvs, inp)

    def _attention_fused(self, spec: ModelSpec) -> bool:
        """Does `CudaDecodeOps.attention` run its kernels here (not its twin)? This card and head dim."""
        return (spec.head_dim in ATTN_HEAD_DIMS
                and torch.cuda.get_device_capability(self.ctx.device) >= ATTN_MIN_CAPABILITY)

    def _decode_never_syncs(self, kernels, spec: ModelSpec) -> bool:
        """Can a decode step run with no host sync (so be captured)? Each layer's experts go through
        the fused kernels, or the dequant gather and the grouped GEMM."""
        if not isinstance(kernels, CudaKernels) or not kernels.host_pointers:
            return False
        fused = all(kernels.moe_fused(lay, spec.hidden, spec.n_experts_used) is not None
                    for lay in self.arena.layouts.values())
        return fused or kernels.grouped_mm_sync_free
