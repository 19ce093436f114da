"""From a `Placement` to the engine's `ModelRunner`: the CPU reference, one stage, or stages in a split."""

from __future__ import annotations

from collections.abc import Callable

import torch

from strata_mgpu.config import Placement
from strata_mgpu.kernels.cpu_experts import default_threads, ggml_missing
from strata_mgpu.kernels.dense import DeviceDense, keeps_blocks
from strata_mgpu.kernels.paths import warn_once
from strata_mgpu.model.expert_layout import layer_layout
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import DecoderRunner, load_reference_runner
from strata_mgpu.model.spec import ModelSpec, T, tname
from strata_mgpu.split.help_rule import HelpPolicy
from strata_mgpu.split.runner import SplitError, SplitRunner, build_split, plan_layers
from strata_mgpu.stage.build import build_stage, check_layers_served, stage_plan
from strata_mgpu.stage.device import DeviceError, check_device, parse_device
from strata_mgpu.stage.host.pinned import PinError
from strata_mgpu.stage.memory_plan import MemoryPlan, PlanError, dense_bytes
from strata_mgpu.stage.stage import Stage, StageOptions

Progress = Callable[[str, int, int], None]
# What a machine that cannot hold a placement raises while it is checked or built: one line to the
# user, no traceback (DeviceError alone: a device that is not there)
PLACEMENT_ERRORS = (DeviceError, PinError, SplitError, PlanError)


# prompt tokens a prefill call takes where --chunk-size gives none: a GPU's chunk of 8K takes a few hundred
# ms, the CPU's would take tens of seconds, and a request that arrives meanwhile waits for the chunk to end
GPU_CHUNK, CPU_CHUNK = 8192, 1024


def default_chunk_size(placement: Placement) -> int:
    """The chunk a server takes where --chunk-size gives none: CPU_CHUNK where every device is the CPU."""
    return CPU_CHUNK if all(d.type == "cpu" for d in resolve_devices(placement)) else GPU_CHUNK


def resolve_devices(placement: Placement) -> list[torch.device]:
    if placement.devices == ("auto",):
        return [torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")]
    return [check_device(parse_device(d)) for d in placement.devices]


def cpu_budget_warning(placement: Placement) -> str | None:
    """--max-vram given for stages that run on the CPU, where it caps nothing: what to tell the user."""
    budgets = [placement.budget(i) for i, d in enumerate(resolve_devices(placement))
               if d.type == "cpu" and placement.budget(i) is not None]
    if not budgets:
        return None
    return f"--max-vram {','.join(f'{b:g}' for b in budgets)} is ignored on the CPU: it caps GPU memory only"


def check_placement(placement: Placement, spec: ModelSpec) -> None:
    """Fail before anything loads: devices that do not exist, a split that does not fit, a model stages
    do not serve on a placement the CPU reference does not take."""
    devices = resolve_devices(placement)
    if spec.reference_only and len(devices) == 1 and devices[0].type == "cpu":
        return  # the CPU reference serves it
    for layers in stage_layers(placement, spec):
        check_layers_served(spec, layers)


def stage_layers(placement: Placement, spec: ModelSpec) -> list[range]:
    n = len(placement.devices)
    return (plan_layers(spec.n_layers, n, placement.layer_split, [placement.budget(i) for i in range(n)]) if n > 1
            else [range(spec.n_layers)])


def stage_options(placement: Placement, chunk_size: int, kv_tokens: int,
                  devices: list[torch.device] | None = None, sequences: int = 16) -> list[StageOptions]:
    """Each stage's options. One CPU device computes its experts on the host's cores; CPU stages of a
    split, and one given `--resident-experts`, keep the device path's twins they are the tests of.
    `sequences`: the most running at once (`--max-running`), each with a hybrid model's DeltaNet state."""
    devices = resolve_devices(placement) if devices is None else devices
    cpu_only = len(devices) == 1 and devices[0].type == "cpu" and placement.resident_experts is None
    n_cuda = sum(d.type == "cuda" for d in devices)
    threads = host_threads(placement, devices)
    # a CUDA stage's threads are its decode hand-over's pool: the GPU stages share the host's cores
    cuda_threads = max(1, threads // max(1, n_cuda))
    return [StageOptions(device=d, switches=placement, max_vram_gib=placement.budget(i), chunk_size=chunk_size,
                         kv_tokens=kv_tokens, context=kv_tokens, host_core_experts=cpu_only, sequences=sequences,
                         threads=cuda_threads if d.type == "cuda" else threads)
            for i, d in enumerate(devices)]


def host_threads(placement: Placement, devices: list[torch.device]) -> int:
    """`--threads`, else the physical cores less one for each GPU stage's host thread."""
    return placement.threads or default_threads(sum(d.type == "cuda" for d in devices))


def preview_plans(f: GGUFFile, spec: ModelSpec, placement: Placement, chunk_size: int, kv_tokens: int,
                  sequences: int = 16) -> list[tuple[str, range, MemoryPlan]]:
    """Each stage's VRAM plan from the file alone (no GPU needed): what `strata info --max-vram` prints,
    and what a stage built on a card with that budget free would plan (`sequences`: `stage_options`')."""
    names = [d.strip() for d in placement.devices]
    options = stage_options(placement, chunk_size, kv_tokens, devices=[parse_device(n) for n in names],
                            sequences=sequences)
    elem = 4 if placement.dtype == "fp32" else 2
    out = []
    for name, opts, layers in zip(names, options, stage_layers(placement, spec), strict=True):
        check_layers_served(spec, layers)
        largest = max(layer_layout(f, spec, i).expert_bytes for i in layers)
        dense = dense_layout_bytes(f, spec, layers, elem=elem, blocks=placement.dense_blocks and elem == 2)
        out.append((name, layers, stage_plan(spec, opts, layers, expert_bytes=largest, dense=dense,
                                             budget=opts.max_vram_bytes, elem=elem, where=f"stage on {name}")))
    return out


def dense_layout_bytes(f: GGUFFile, spec: ModelSpec, layers: range, *, elem: int, blocks: bool) -> int:
    """A GPU stage's dense weights as its plan counts them, the projections it keeps as blocks at their
    blocks' bytes, plus a prompt's transient bf16 copy of one."""
    embed, head = layers.start == 0, layers.stop == spec.n_layers
    total = dense_bytes(spec, len(layers), embed=embed, head=head, elem=elem, first=layers.start)
    if not blocks:
        return total
    names = [tname(kind, i) for i in layers for kind in projection_kinds(spec, i)]
    if head and not spec.tied_output:
        names.append(tname(T.OUTPUT))
    kept = [info for info in map(f.tensor, names) if keeps_blocks(info.ggml_type, info.shape[-1])]
    return total - sum(info.n_elements * elem - info.nbytes for info in kept) + (DeviceDense.scratch_bytes
                                                                                 if kept else 0)


def projection_kinds(spec: ModelSpec, layer: int) -> tuple[T, ...]:
    """The projections of a layer that `load_weights` keeps as blocks where the stage multiplies them so."""
    mixer = (T.ATTN_QKV, T.ATTN_GATE, T.SSM_OUT) if spec.is_linear(layer) else (T.ATTN_Q, T.ATTN_K, T.ATTN_V,
                                                                                    T.ATTN_OUT)
    shared = (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP) if spec.shared_expert_ffn else ()
    return mixer + shared


def build_runner(f: GGUFFile, spec: ModelSpec, placement: Placement, chunk_size: int, *,
                 kv_tokens: int | None = None, cpu_reference: bool = False, sequences: int = 16,
                 on_progress: Progress | None = None) -> DecoderRunner | Stage | SplitRunner:
    """`build_stages`; with `cpu_reference` (what `serve` asks for), one CPU device without ggml-python
    serves the fp32 oracle instead, said once (the stage's torch twin would be slower), and so does one
    CPU device for a hybrid model (its CPU stage's host-core path is not checked against the oracle yet).
    `sequences`: the most running at once (`--max-running`), for the plan's DeltaNet state line."""
    devices = resolve_devices(placement)
    one_cpu = cpu_reference and len(devices) == 1 and devices[0].type == "cpu"
    if (spec.hybrid or spec.reference_only) and one_cpu:  # on the host: the fp32 reference
        return load_reference_runner(f, spec, on_progress=(lambda d, t: on_progress("layers", d, t))
                                     if on_progress else None, kv_types=placement.kv_types)
    missing = ggml_missing() if one_cpu else None
    if missing is not None:
        warn_once("serving the fp32 reference forward on the CPU (every expert dequantized in RAM)", missing)
        return load_reference_runner(f, spec, on_progress=(lambda d, t: on_progress("layers", d, t))
                                     if on_progress else None, kv_types=placement.kv_types)
    return build_stages(f, spec, placement, chunk_size, kv_tokens=kv_tokens, sequences=sequences,
                        on_progress=on_progress)


def build_stages(f: GGUFFile, spec: ModelSpec, placement: Placement, chunk_size: int, *,
                 kv_tokens: int | None = None, sequences: int = 16,
                 on_progress: Progress | None = None) -> Stage | SplitRunner:
    """One device: a Stage; several: a SplitRunner. `kv_tokens`: the KV cells every stage's memory
    plan keeps for all sequences together (default: one sequence of the whole context); `sequences`:
    `stage_options`'."""
    options = stage_options(placement, chunk_size, kv_tokens or spec.context_length, sequences=sequences)
    if len(options) == 1:
        return build_stage(f, spec, options[0], on_progress=on_progress)
    policy = HelpPolicy.of(placement.prefill_help, placement.prefill_help_frac)
    return build_split(f, spec, options, placement.layer_split, on_progress=on_progress, help_policy=policy,
                       help_halves=placement.help_halves, stage_threads=placement.stage_threads)
