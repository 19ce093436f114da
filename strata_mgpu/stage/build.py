"""`build_stage`: a `Stage` composed of its parts, in the order their memory is placed.

The dense weights go to the device first, the layers' experts into the pinned host arena; the
kernels are chosen once; the VRAM plan then fits the rest of the budget around what is placed. A
CPU stage with `host_core_experts` keeps only the arena (not pinned) and computes every expert
from it on the host's cores: no ring, no expert cache, no workspace.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable

import torch

from strata_mgpu.kernels.cpu_experts import GgmlExperts, default_threads, ggml_missing, select_cpu_experts
from strata_mgpu.kernels.decode_ops import ATTN_HEAD_DIMS, ATTN_MIN_CAPABILITY, CudaDecodeOps
from strata_mgpu.kernels.delta_rule import fla_delta_scan
from strata_mgpu.kernels.dense import DeviceDense, keeps_blocks
from strata_mgpu.kernels.experts import CudaKernels, TorchKernels, select_kernels
from strata_mgpu.model.decoder import Decoder, DenseMatmul, float_matmul
from strata_mgpu.model.delta_net import delta_rule_chunked
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.weights import BlockMatrix, LayerWeights, ModelWeights, every_type, load_weights
from strata_mgpu.stage.device import DeviceContext, DeviceError
from strata_mgpu.stage.experts.break_even import PassRates, measure_compute, measure_mapped_rate
from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.experts.cpu_handover import HANDOVER_POLL, CpuHandover
from strata_mgpu.stage.experts.handover import MAX_EXPERTS, Handover
from strata_mgpu.stage.experts.handover_twin import HandoverTwin
from strata_mgpu.stage.experts.host_cores import HostCoreExperts, HostDense
from strata_mgpu.stage.experts.residency import LfuPolicy, Residency
from strata_mgpu.stage.experts.ring import ExpertRing
from strata_mgpu.stage.experts.streamed import StreamedExperts
from strata_mgpu.stage.graphs.replay import DecodeGraphs
from strata_mgpu.stage.host.arena import HostExpertArena
from strata_mgpu.stage.host.link import link_rate, measure_link_rate
from strata_mgpu.stage.kv.allocator import StageKV
from strata_mgpu.stage.memory_plan import MemoryPlan, kv_layers, plan_stage_memory
from strata_mgpu.stage.stage import Stage, StageOptions, StageReport

log = logging.getLogger("strata.stage")
# (what is loading, done, total): a stage counts its own layers from 1
Progress = Callable[[str, int, int], None]


def check_layers_served(spec: ModelSpec, layers: range) -> None:
    """A stage serves every layer kind of the registered archs: full attention, and a hybrid model's
    gated DeltaNet layers (qwen35moe, qwen3next) with their state beside each sequence's KV (a slot of
    the decoder's `StatePool`, so its decode steps replay graphs too). What it does not serve is part
    of a hybrid model's layers: a `--layer-split` of one would need each stage's DeltaNet state and
    snapshots carried through the split's sequences, which is not built (docs/ARCHITECTURE.md); nor
    gpt-oss's layers, nor glm4moe's dense first layers, attention biases and sigmoid router
    (`ModelSpec.reference_only`): the CPU reference serves those."""
    if spec.reference_only:
        lacking = ("attention sinks, sliding windows, biased clamped-SwiGLU experts" if spec.gpt_oss is not None
                   else "dense first layers, attention biases, the sigmoid router")
        raise DeviceError(f"{spec.arch} ({lacking}) is served by the CPU reference only for now "
                          f"(strata serve --devices cpu)")
    if spec.hybrid and layers != range(spec.n_layers):
        raise DeviceError(f"{spec.arch} (gated DeltaNet layers) runs on one device only for now: its layers "
                          f"cannot be split across stages (drop --layer-split, give one device)")


def build_stage(f: GGUFFile, spec: ModelSpec, opts: StageOptions, layers: range | None = None,
                on_progress: Progress | None = None) -> Stage:
    layers = layers if layers is not None else range(spec.n_layers)
    check_layers_served(spec, layers)
    assert 0 <= layers.start < layers.stop <= spec.n_layers and layers.step == 1
    first, last = layers.start == 0, layers.stop == spec.n_layers
    switches = opts.switches
    ctx = DeviceContext(opts.device, opts.max_vram_bytes)
    if opts.host_core_experts and ctx.is_cuda:
        raise ValueError(f"host_core_experts is a CPU stage's option; the stage is on {ctx.device}")
    dtype = opts.compute_dtype

    def progress(what: str, total: int) -> Callable[[int], None]:
        # on_layer gets the global layer id: count from this stage's first layer
        return (lambda i: on_progress(what, i - layers.start + 1, total)) if on_progress else (lambda i: None)

    tag = "" if first and last else f" {layers.start}-{layers.stop - 1} on {ctx.device}"
    executor = (select_cpu_experts(opts.threads or default_threads(0), switches.adapt_threads)
                if opts.host_core_experts else None)
    kernels = select_kernels(ctx.device, prefer_cuda=opts.prefer_cuda_kernels)
    # Which projections stay as the file's blocks: a CPU stage computing on the host's cores through
    # ggml multiplies every type from its blocks (`HostDense`; the torch twin would dequantize them
    # every call: floats there); a bf16 GPU stage with the CUDA kernels those dense_q8 dots
    # (`DeviceDense`): decode reads them at half bf16's bytes or less, and they take that much less VRAM
    host_blocks = isinstance(executor, GgmlExperts)
    device_blocks = switches.dense_blocks and isinstance(kernels, CudaKernels) and dtype == torch.bfloat16
    dense = load_weights(f, spec, dtype=dtype, device=ctx.device, with_experts=False, layers=layers, embed=first,
                         head=last, blocks=every_type if host_blocks else keeps_blocks if device_blocks else None,
                         embed_blocks=host_blocks, on_layer=progress("dense weights" + tag, len(layers)))
    # a file of other dense types keeps none: then nothing to compile
    device_dense = (DeviceDense(kernels) if device_blocks and isinstance(kernels, CudaKernels) and holds_blocks(dense)
                    else None)
    arena = HostExpertArena(f, spec, layers, pin=ctx.is_cuda, on_layer=progress("experts" + tag, len(layers)))
    # the dense line counts a prompt's transient bf16 copy of a projection kept as blocks
    plan = _plan(ctx, spec, opts, layers, arena,
                 dense_storage_bytes(dense) + (device_dense.scratch_bytes if device_dense else 0), dtype)
    ring = ExpertRing(ctx, plan.ring_slot_bytes, opts.ring_slots) if plan.ring else None
    cache = (ExpertCache(ctx, arena, layers, plan.resident_per_layer * len(layers))
             if opts.expert_cache and not opts.host_core_experts else None)
    experts: StreamedExperts | HostCoreExperts
    dense_matmul: DenseMatmul = device_dense or float_matmul
    if executor is not None:
        experts = HostCoreExperts(arena, executor, kernels, layers)
        if host_blocks:
            dense_matmul = HostDense(experts)
    else:
        experts = StreamedExperts(ctx, spec, arena, kernels, ring, cache, layers, dtype=dtype)
        experts.attach_handover(_handover(ctx, spec, opts, arena, cache, kernels, layers, dtype),
                                prompts=switches.host_prompt_help)
        experts.set_gather_rule(_pass_rates(ctx, kernels, arena, ring, experts) if experts.partly_resident else None,
                                floor_rows=switches.decode_graph_batch, fixed_rows=switches.gather_rows)
        if experts.partly_resident:
            log.info("stage on %s: a pass of fewer than %d rows gathers its picked experts, longer ones stream "
                     "whole layers (%s)", ctx.device, experts.stream_rows(),
                     f"STRATA_GATHER_ROWS={switches.gather_rows}" if switches.gather_rows is not None else
                     _rates_line(experts.rates))
    fused_ops = isinstance(kernels, CudaKernels) and dtype == torch.bfloat16
    # one path counter for the kernels and the fused ops
    ops = CudaDecodeOps(ctx.device, paths=kernels.paths, kv_types=switches.kv_types) if fused_ops else None
    # Short prompts, packed prompts and eager decode batches through the decode step's fused ops:
    # the host's launches, not the GPU, bind a short prompt on the segment path
    # (docs/ARCHITECTURE.md). Only where their attention runs fused: its twin costs a dozen
    # launches a row.
    scan = fla_delta_scan(ctx.device, kernels.paths) if spec.hybrid and switches.delta_scan == "fla" else None
    model = Decoder(spec, dense, experts, ops, static_rows=fused_ops and _attention_fused(ctx, spec),
                    kv_types=switches.kv_types, dense=dense_matmul, delta_scan=scan or delta_rule_chunked,
                    state_slots=opts.sequences)
    # graphs replay the fused ops' step (`Decoder.step_static`), which serves plain attention layers and a
    # hybrid model's (gated attention, DeltaNet states by slot in its `StatePool`); not other layer kinds
    graphs = DecodeGraphs(ctx, model, enabled=(switches.cuda_graphs and cache is not None and dtype == torch.bfloat16
                                               and (spec.fused_attention or spec.hybrid)
                                               and _decode_never_syncs(kernels, arena, spec)),
                          largest=switches.decode_graph_batch, pad=plan.resident_share >= 1, first=first)
    kv = StageKV(ctx, spec, layers, vram_cells=plan.kv_tokens, context=opts.context or 0, dtype=dtype,
                 prefetch=switches.kv_prefetch, kv_types=switches.kv_types)
    report = StageReport(dense_bytes=dense_storage_bytes(dense), arena_bytes=arena.nbytes,
                         ring_bytes=ring.nbytes if ring else 0, workspace_bytes=experts.workspace_bytes,
                         cache_slots=cache.n_slots if cache else 0, plan=plan,
                         kernels=kernels.describe() + (f", experts {experts.executor.describe()}"
                                                       if isinstance(experts, HostCoreExperts) else ""),
                         pass_bytes=experts.pass_bytes())
    if isinstance(experts, HostCoreExperts):
        log.info("stage on %s: experts %.2f GB in host RAM, computed there; kernels %s", ctx.device,
                 arena.nbytes / 1e9, report.kernels)
    else:
        log.info("stage on %s: experts %.2f GB pinned, %d/%d a layer resident, a prompt pass streams %.2f GB, "
                 "kernels %s", ctx.device, arena.nbytes / 1e9, plan.resident_per_layer, spec.n_experts,
                 report.pass_bytes / 1e9, report.kernels)
    log.info("memory plan of %s: %s", ctx.device, plan.describe())
    return Stage(options=opts, spec=spec, layers=layers, ctx=ctx, arena=arena, plan=plan, kernels=kernels,
                 experts=experts, model=model, kv=kv, graphs=graphs, report=report,
                 refill=Residency(cache, LfuPolicy(switches.residency_half_life), switches.residency_swaps))


def _handover(ctx: DeviceContext, spec: ModelSpec, opts: StageOptions, arena: HostExpertArena,
              cache: ExpertCache | None, kernels: TorchKernels, layers: range, dtype: torch.dtype
              ) -> Handover | None:
    """The decode hand-over of missing experts to the host's cores, where `cpu_experts` asks for one and
    it can run: a CUDA stage whose experts are not all resident, every layer through the fused
    decode kernels in bf16, ggml-python there. A CPU stage's device-path twins take a fixed share
    through `HandoverTwin`. Says what it chose, and why not, in the log."""
    share = opts.switches.cpu_experts
    if share.mode == "off" or cache is None or cache.per_layer >= spec.n_experts:
        return None
    threads = opts.threads or default_threads(1)
    if not ctx.is_cuda:
        if share.mode != "fixed":
            return None
        return HandoverTwin(arena, cache, select_cpu_experts(threads), layers, share.fraction)
    why_not = ggml_missing()
    if why_not is None and not (isinstance(kernels, CudaKernels) and dtype == torch.bfloat16 and all(
            kernels.moe_fused(arena.layouts[layer], spec.hidden, spec.n_experts_used) for layer in layers)):
        why_not = "the fused decode kernels do not serve every layer here"
    if why_not is None and platform.machine().lower() not in ("x86_64", "amd64"):
        why_not = f"a {platform.machine()} host (its flags are plain loads and stores, in order on x86 only)"
    if why_not is None and spec.n_experts > MAX_EXPERTS:
        why_not = f"{spec.n_experts} experts a layer (at most {MAX_EXPERTS})"
    if why_not is not None:
        log.info("stage on %s: decode computes every missing expert over the link (--cpu-experts %s: %s)",
                 ctx.device, share, why_not)
        return None
    executor = GgmlExperts(threads, poll=HANDOVER_POLL)
    handover = CpuHandover(ctx, arena, cache, executor, layers, share.fraction)
    if share.mode == "auto":
        link = link_rate(ctx) or measure_link_rate(ctx) or 0.0
        fraction = handover.calibrate(link)
        assert handover.auto is not None
        host = handover.auto.host
        log.info("stage on %s: the host's cores compute experts at %.1f GB/s after %.0f us a request (%d threads), "
                 "the link brings them at %.1f GB/s: --cpu-experts auto takes %s", ctx.device,
                 host.bytes_per_s / 1e9, 1e6 * host.overhead_s, threads, link / 1e9,
                 f"{fraction:.2f} of the misses" if fraction else "none (the link alone is faster)")
        if fraction == 0:
            handover.close()
            executor.close()
            return None
    log.info("stage on %s: decode hands %s", ctx.device, handover.describe())
    return handover


def _pass_rates(ctx: DeviceContext, kernels: TorchKernels, arena: HostExpertArena, ring: ExpertRing | None,
                experts: StreamedExperts) -> PassRates | None:
    """The link probe's rate, the kernels' reads of the mapped arena (into a ring slot, before any pass
    holds the ring) and the card's compute of a pick and of an expert: what a pass's break-even is
    reckoned from; None where unmeasured (the CPU)."""
    if ring is None or experts.cache is None:
        return None
    slot = ring.slots[0].buffer
    link = link_rate(ctx) or measure_link_rate(ctx, into=slot)
    mapped = measure_mapped_rate(ctx, kernels, arena.buffer, slot)
    if not (link and mapped):
        return None
    ws = experts.workspace
    compute = measure_compute(kernels, experts.cache, arena.layouts[experts.layers[0]], ws.w_gate_up, ws.w_down,
                              experts.spec.hidden, experts.spec.n_experts_used)
    return PassRates(link, mapped) if compute is None else PassRates(link, mapped, *compute)


def _rates_line(rates: PassRates | None) -> str:
    if rates is None:
        return "no measured rates: from E picks"
    return (f"the break-even of the link's {rates.link_bytes_per_s / 1e9:.1f} GB/s against mapped reads' "
            f"{rates.mapped_bytes_per_s / 1e9:.1f} GB/s, {1e6 * rates.pick_s:.2f} us a gathered pick and "
            f"{1e6 * rates.expert_s:.2f} us an expert dequantized, at the cache's expected hit rate")


def holds_blocks(dense: ModelWeights) -> bool:
    return any(isinstance(m, BlockMatrix) for lw in dense.layers for m in layer_tensors(lw)) or \
        isinstance(dense.output, BlockMatrix)


def layer_tensors(lw: LayerWeights) -> list[object]:
    """Every weight a layer holds: its own fields, its DeltaNet mixer's and its shared expert's."""
    parts = [lw, *(p for p in (lw.delta, lw.shared) if p is not None)]
    return [t for p in parts for t in vars(p).values()]


def dense_storage_bytes(dense: ModelWeights) -> int:
    """Bytes of every storage of the dense weights once (wq/wk/wv are views of wqkv; a tied head is the
    embedding)."""
    held = [*(t for lw in dense.layers for t in layer_tensors(lw)), dense.embed, dense.output, dense.out_norm]
    tensors = [t.raw if isinstance(t, BlockMatrix) else t for t in held if isinstance(t, torch.Tensor | BlockMatrix)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _plan(ctx: DeviceContext, spec: ModelSpec, opts: StageOptions, layers: range, arena: HostExpertArena,
          dense_bytes: int, dtype: torch.dtype) -> MemoryPlan:
    """The stage's VRAM plan within what the budget and the card leave, the placed dense weights counted."""
    budget = None
    if ctx.is_cuda:  # what may still be allocated, plus the dense weights already placed
        budget = ctx.vram_free_in_budget() + torch.cuda.memory_reserved(ctx.device)
        budget = min(budget, ctx.max_vram_bytes) if ctx.max_vram_bytes else budget

    def halved(had: int, now: int) -> None:
        log.warning("stage on %s: the budget cannot hold %d tokens of KV in VRAM; trying %d, with longer "
                    "sequences' older KV in host RAM", ctx.device, had, now)

    return stage_plan(spec, opts, layers, expert_bytes=arena.max_expert_bytes, dense=dense_bytes, budget=budget,
                      elem=torch.empty((), dtype=dtype).element_size(), where=f"stage on {ctx.device}",
                      on_halved=halved)


def stage_plan(spec: ModelSpec, opts: StageOptions, layers: range, *, expert_bytes: int, dense: int,
               budget: int | None, elem: int, where: str,
               on_halved: Callable[[int, int], None] = lambda had, now: None) -> MemoryPlan:
    """The VRAM plan of a stage of `layers`, also what `strata info` previews without a GPU. `budget`
    None: uncapped (the CPU). `host_core_experts`: no ring, resident experts or workspace."""
    switches, on_host = opts.switches, opts.host_core_experts
    return plan_stage_memory(spec, kv_tokens=opts.kv_tokens, context=opts.context or opts.kv_tokens,
                             chunk_tokens=opts.chunk_size, on_halved=on_halved, n_layers=len(layers),
                             expert_bytes=expert_bytes, dense=dense, budget=budget,
                             ring_slots=0 if on_host else opts.ring_slots, elem=elem,
                             resident_per_layer=switches.resident_experts if opts.expert_cache and not on_host
                             else 0, expert_workspace=not on_host,
                             where=where, staging_buffers=2 if switches.kv_prefetch else 1,
                             decode_rows=switches.decode_graph_batch, kv_types=switches.kv_types,
                             head=layers.stop == spec.n_layers, kv_layers=kv_layers(spec, layers),
                             linear_state=spec.linear_state_bytes(layers=layers), sequences=opts.sequences)


def _attention_fused(ctx: DeviceContext, spec: ModelSpec) -> bool:
    return spec.head_dim in ATTN_HEAD_DIMS and torch.cuda.get_device_capability(ctx.device) >= ATTN_MIN_CAPABILITY


def _decode_never_syncs(kernels: TorchKernels, arena: HostExpertArena, spec: ModelSpec) -> bool:
    """Can a decode step run with no host sync (so be captured)? Each layer's experts go through the
    fused kernels, or the dequant gather and the grouped GEMM."""
    if not isinstance(kernels, CudaKernels) or not kernels.host_pointers:
        return False
    fused = all(kernels.moe_fused(lay, spec.hidden, spec.n_experts_used) is not None
                for lay in arena.layouts.values())
    return fused or kernels.grouped_mm_sync_free
