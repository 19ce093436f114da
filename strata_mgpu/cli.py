"""The `strata` command line: parse, build config, call. No logic of its own."""

from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from strata_mgpu import env, report
from strata_mgpu.config import KV_CACHE_TYPE_NAMES
from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.progress import layer_bars
from strata_mgpu.quant.formats import parse_type
from strata_mgpu.server.dialects import PARSER_NAMES

out = Console()
err = Console(stderr=True)


def fail(message: str) -> None:
    """One line on stderr, exit status 1: the way every user-facing error ends."""
    raise click.ClickException(message.replace("\n", " "))


def _type_option(value: str | None):
    if value is None:
        return None
    try:
        return parse_type(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _size(value: str | None) -> int:
    """'500M', '2G', '123' -> bytes."""
    if not value:
        return 0
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", value, re.IGNORECASE)
    if not m:
        raise click.BadParameter(f"{value!r} is not a size like 500M or 2G")
    return int(float(m[1]) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m[2].upper()])


def _template_file(path: Path) -> str:
    """A chat template file's text (ValueError: not UTF-8)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-template {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _model_file(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    """A directory given as the model: the one-line error of any model that cannot be opened
    (GGUFError's words), not a usage error."""
    if value is not None and value.is_dir():
        fail(f"{value}: cannot open: {os.strerror(errno.EISDIR)}")
    return value


# llama.cpp's options with no counterpart here, and what to use instead. Checked before click parses,
# since click would read `-ngl` as the cluster `-n -g -l` ("No such option: -n") or, where `-n` is an
# option, as `-n gl`.
NO_COUNTERPART = {
    ("-ngl", "--n-gpu-layers", "--gpu-layers"): (
        "strata places by VRAM budget, not by layers: dense weights go to the GPU and as many experts as "
        "the budget holds; give --max-vram GiB (and --devices)"),
    ("-ncmoe", "--n-cpu-moe", "-cmoe", "--cpu-moe"): (
        "every expert lives in host RAM and streams to the GPU; --cpu-experts auto|off|F says what share of "
        "the experts missing from VRAM the host's cores compute"),
    ("-ot", "--override-tensor"): "experts stay in host RAM by design; see --max-vram and --cpu-experts",
    ("-ts", "--tensor-split", "-sm", "--split-mode"): "use --devices 0,1 with --layer-split and --max-vram 16,12",
    ("-dev", "--device"): "use --devices (cpu, cuda:N or N, comma-separated)",
    ("-b", "--batch-size", "-ub", "--ubatch-size"): "use --chunk-size (prompt tokens per prefill step)",
    ("-fa", "--flash-attn"): "attention always runs fused here: drop it",
    ("-hf", "--hf-repo"): "give the path of a GGUF file",
}
# llama-server's switches for what strata always does: the GGUF's chat template, continuous batching,
# /metrics, one KV for all sequences (and no web UI to turn off)
ACCEPTED_AS_IS = ("--jinja", "-cb", "--cont-batching", "--metrics", "-kvu", "--kv-unified", "--no-webui")


class LlamaCppSpellings(click.Command):
    """A command that also reads llama.cpp's habits: `-m FILE` / `--model FILE` as the model argument,
    `--jinja` and the like as what is done anyway (`ACCEPTED_AS_IS`), and for its options with no
    counterpart (`NO_COUNTERPART`) a usage error naming the option and what to use. Its short
    spellings with the same meaning (`-c`, `-np`, `-ctk`, ...) are the options' own names."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("epilog", "llama.cpp's spellings: -m FILE is the model; --jinja is what strata does "
                                    "anyway; -ngl: use --max-vram; --n-cpu-moe / --cpu-moe: use --cpu-experts.")
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        hints = {name: hint for names, hint in NO_COUNTERPART.items() for name in names}
        options = [p for p in self.get_params(ctx) if isinstance(p, click.Option)]
        known = {name for p in options for name in (*p.opts, *p.secondary_opts)}
        valued = {name for p in options if not p.is_flag and not p.count for name in p.opts}
        kept: list[str] = []
        rest = iter(args)
        for arg in rest:
            if arg == "--":
                kept += [arg, *rest]
                break
            name, eq, value = arg.partition("=")
            if name in hints:
                raise click.UsageError(f"{name}: llama.cpp's option, not strata's: {hints[name]}", ctx)
            if name in ("-m", "--model"):
                model = value if eq else next(rest, None)
                if model is None:
                    raise click.UsageError(f"{name} needs the model's file", ctx)
                kept.append(model)
                continue
            if arg in ACCEPTED_AS_IS:
                continue
            if _clustered(arg, known, valued):
                raise click.UsageError(f"no such option: {arg} (--help lists the options)", ctx)
            kept.append(arg)
            if name in valued and not eq:  # its value, whatever it looks like (`--api-key -fa` is a key)
                kept += [v for v in (next(rest, None),) if v is not None]
        return super().parse_args(ctx, kept)


def _clustered(arg: str, known: set[str], valued: set[str]) -> bool:
    """An unknown word after one dash (`-cnv`), which click would read as a cluster of one-letter
    options (`-c nv`) and fault on one of them: not a name, nor a one-letter option and its number
    written together (`-c4096`)."""
    if not arg.startswith("-") or arg.startswith("--") or len(arg) <= 2 or arg.partition("=")[0] in known:
        return False
    return not (arg[:2] in valued and re.fullmatch(r"\d+(\.\d+)?", arg[2:]))


_RAM_UNITS = {"": 2**20, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
              "t": 2**40, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def _ram_gib(_ctx: click.Context | None, _param: click.Parameter | None, value: str) -> float:
    """'8GiB', '8192MiB', '8G', '512M' (K, M, G, T binary, as llama.cpp and free -h have them; KB, MB,
    GB decimal); a bare number is MiB, as llama-server reads --cache-ram -> GiB."""
    if value.strip() == "-1":
        raise click.BadParameter("llama-server's -1 (no limit) has no counterpart: give a size, such as 8GiB (a "
                                 "bare number is MiB); the cache never takes more than half the RAM free")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", value, re.IGNORECASE)
    if not m or m[2].lower() not in _RAM_UNITS:
        raise click.BadParameter(f"{value!r} is not a size like 8GiB, 8192MiB or 8G (a bare number is MiB, "
                                 f"as llama-server reads it)")
    if not m[2] and 0 < float(m[1]) < 1024:  # strata's older reading of a bare number was GiB
        err.print(f"warning: --cache-ram {value.strip()} is {value.strip()} MiB (a bare number is MiB, as "
                  f"llama-server reads it); write {value.strip()}GiB for GiB")
    return float(m[1]) * _RAM_UNITS[m[2].lower()] / 2**30


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata-mgpu")
@click.pass_context
def main(ctx: click.Context) -> None:
    """strata-mgpu: serve Mixture-of-Experts GGUF models with experts streamed from host RAM."""
    try:  # every variable, whatever the command: a bad value fails here, not where it would be read
        ctx.obj = env.read()
    except env.EnvError as e:
        fail(str(e))
    env.default_allocator_config()  # before any CUDA allocation


def _env() -> env.EnvOptions:
    """The environment as the group read it at start-up."""
    options = click.get_current_context().find_object(env.EnvOptions)
    assert options is not None, "commands run under the group"
    return options


@main.command("gen-model")
@click.argument("out_path", metavar="OUT.gguf", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "small", "30b-a3b", "235b-a22b", "tiny-hybrid", "tiny-next",
                                                  "35b-a3b-hybrid", "tiny-gpt-oss", "gpt-oss-20b", "gpt-oss-120b",
                                                  "tiny-glm4moe", "glm-4.5-air"]),
              default="tiny", show_default=True,
              help="qwen3moe shapes, qwen35moe's (-hybrid), qwen3next's (-next), gpt-oss's (gpt-oss) or glm4moe's "
                   "(-glm4moe, glm-4.5-air)")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="write only the preset's first N layers")
@click.option("--expert-type", default=None, help="type of the experts' gate and up (default: the preset's, "
                                                  "Q4_K; MXFP4 for gpt-oss)")
@click.option("--down-type", default=None, help="type of the experts' down (default: Q6_K for Q4_K/Q5_K)")
@click.option("--mix", default=None, help="experts' types by layer, FIRST[-[LAST]]:GATE_UP[/DOWN],... "
                                          "(e.g. 0-3:Q6_K,4-:Q4_K); other layers: --expert-type/--down-type")
@click.option("--dense-type", default="Q8_0", show_default=True, help="type of attention, embedding, head")
@click.option("--rope-scaling", default="none", show_default=True,
              help="none, linear:FACTOR[:ORIGINAL] or yarn:FACTOR[:ORIGINAL] (e.g. yarn:4:32768); the file's "
                   "context is then FACTOR x ORIGINAL (ORIGINAL: the preset's context)")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--split-max-size", default=None, help="split into shards of at most this size (e.g. 2G)")
@click.option("--chat-template", "chat_template_file", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a jinja chat template file to write as the model's (default: the preset's: gpt-oss's own for "
                   "its presets, else the synthetic ChatML one)")
@click.option("--vocab", "vocab_family", type=click.Choice(["qwen", "harmony", "glm"]), default=None,
              help="the added tokens: Qwen3's, gpt-oss's (harmony) or GLM-4.5's (default: the family the "
                   "--chat-template writes, where it is one; else the preset's)")
def gen_model(out_path: Path, preset: str, layers: int | None, expert_type: str | None, down_type: str | None,
              mix: str | None, dense_type: str, rope_scaling: str, seed: int, split_max_size: str | None,
              chat_template_file: Path | None, vocab_family: str | None) -> None:
    """Write a synthetic qwen3moe (or qwen35moe, qwen3next, gpt-oss: as the preset says) GGUF with real
    quantized blocks."""
    from strata_mgpu.model import synthetic as syn
    from strata_mgpu.model.tokenizer import ChatTemplate
    from strata_mgpu.model.vocab import DEFAULT_FAMILY, family_of_template

    e_type = syn.PRESETS[preset].expert_type if expert_type is None else _type_option(expert_type)
    d_type, dn_type = _type_option(dense_type), _type_option(down_type)
    down = syn.DEFAULT_DOWN.get(e_type, e_type) if dn_type is None else dn_type  # F32 is 0: no `or`
    try:
        rope = syn.rope_option(rope_scaling, syn.PRESETS[preset].context_length)
        spec = syn.preset_spec(preset, layers, rope)
        types = syn.mix_option(mix, spec.n_layers) if mix else None
        total = sum(p.nbytes for p in syn.plan_tensors(spec, e_type, down, d_type, types))
        template = syn.preset_template(preset) if chat_template_file is None else _template_file(chat_template_file)
        ChatTemplate(template)  # a template that does not parse is refused here, not at load
        family = vocab_family or family_of_template(template) or DEFAULT_FAMILY
    except ValueError as e:
        fail(str(e))
    with Progress(TextColumn("[bold]writing[/] {task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True) as bar:
        task = bar.add_task(out_path.name, total=total)
        syn.write_model(out_path, preset, expert_type=e_type, down_type=down, dense_type=d_type, seed=seed,
                        split_max_bytes=_size(split_max_size), layers=layers, rope=rope, mix=types,
                        chat_template=template, vocab_family=family,
                        on_tensor=lambda _name, nbytes: bar.advance(task, nbytes))
    scaled = f", RoPE {report.rope_text(spec.rope_scaling)}" if spec.rope_scaling != syn.NO_ROPE_SCALING else ""
    err.print(f"wrote {out_path} ({preset}, {spec.n_layers} layers, experts {e_type.name}/{down.name}"
              f"{' outside --mix' if types else ''}, dense {d_type.name}{scaled}, {report.gb(total)} of tensors, "
              f"{family} vocabulary, seed {seed})")


devices_option = click.option("--devices", default="auto", show_default=True,
                              help="one device per stage: cpu, cuda:N or N, comma-separated (0,1; 0,0; cpu,cpu); "
                                   "auto: cuda:0 when CUDA is there, else cpu")
layer_split_option = click.option("--layer-split", default="auto", show_default=True,
                                  help="auto (by VRAM budget) or K1[,K2..]: the first layer of each later stage")
max_vram_option = click.option("--max-vram", default=None,
                               help="GiB of VRAM each stage may use: one value, or one per device (16,12)")
def help_options(f):
    f = click.option("--prefill-help-frac", default=None,
                     help="the helper's share of each layer's experts: auto (the rate model), rule, or fixed "
                          "0 < f < 1; default: STRATA_PREFILL_HELP_FRAC, else auto")(f)
    return click.option("--prefill-help/--no-prefill-help", default=None,
                        help="the idle stage helps one-chunk prompts (default: STRATA_PREFILL_HELP, on)")(f)


dtype_option = click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
                            help="compute dtype on the GPU (fp32: slower, for checks)")


def _threads(_ctx: click.Context, _param: click.Parameter, value: int | None) -> int | None:
    """--threads, at most the CPUs this process may use (said once, on stderr)."""
    if value is None:
        return None
    from strata_mgpu.kernels.cpu_experts import clamp_threads

    threads, warning = clamp_threads(value)
    if warning:
        err.print(f"warning: {warning}")
    return threads


threads_option = click.option("--threads", "-t", type=click.IntRange(min=1), default=None, callback=_threads,
                              help="host cores that compute a CPU stage's experts (ggml), at most the CPUs this "
                                   "process may use; default: the physical cores, less one for each GPU stage's "
                                   "host thread")
cpu_experts_option = click.option(
    "--cpu-experts", default="auto", show_default=True,
    help="decode: the share of a GPU stage's missing experts (those not resident in VRAM) the host's cores "
         "compute while the link brings the rest: auto (from the host's and the link's measured rates; none "
         "where the link alone is faster), off, or a share 0 < F <= 1 (needs the cpu-experts extra)")
def cache_type_options(f):
    """--cache-type-k / --cache-type-v (llama.cpp's names): how the KV cache stores keys and values."""
    for which in ("v", "k"):
        f = click.option(f"--cache-type-{which}", f"-ct{which}", type=click.Choice(KV_CACHE_TYPE_NAMES),
                         default="bf16", show_default=True,
                         help=f"how the KV cache stores {'keys' if which == 'k' else 'values'}: bf16 (the compute "
                              "dtype) or q8_0 (ggml's 8-bit blocks: 0.53 of the bytes, so more resident experts "
                              "or KV at a budget)")(f)
    return f


resident_option = click.option("--resident-experts", type=click.IntRange(min=0), default=None,
                               help="force this many resident experts a layer (0: stream every expert, as "
                                    "without residency); default: as many as the VRAM plan holds")


@main.command()
@click.argument("model", type=click.Path(path_type=Path), callback=_model_file)
@click.option("--link-gbps", default=25.0, show_default=True, type=click.FloatRange(min=0.001),
              help="host-to-device link speed (GB/s) for the expert-pass time")
@max_vram_option
@devices_option
@layer_split_option
@click.option("--ctx-size", default=None, type=click.IntRange(min=1),
              help="KV cells to plan for (default: the model's context)")
@click.option("--chunk-size", default=8192, show_default=True, type=click.IntRange(min=1))
@resident_option
@cache_type_options
def info(model: Path, link_gbps: float, max_vram: str | None, devices: str, layer_split: str, ctx_size: int | None,
         chunk_size: int, resident_experts: int | None, cache_type_k: str, cache_type_v: str) -> None:
    """Shapes, parameters, bytes by type and expert traffic of a GGUF model; with --max-vram, each
    stage's VRAM plan (no GPU needed)."""
    from strata_mgpu.config import EngineConfig
    from strata_mgpu.engine.build import preview_plans
    from strata_mgpu.model.info import model_info
    from strata_mgpu.model.spec import spec_from_gguf
    from strata_mgpu.split.runner import SplitError
    from strata_mgpu.stage.device import DeviceError
    from strata_mgpu.stage.memory_plan import PlanError

    try:
        with GGUFFile(model) as f:
            mi = model_info(f)
            plans = []
            if max_vram:
                placement = _placement(devices if devices != "auto" else "cuda:0", layer_split, max_vram, "bf16",
                                       resident_experts=resident_experts, cache_types=(cache_type_k, cache_type_v))
                spec = spec_from_gguf(f)
                engine = EngineConfig(ctx_size=ctx_size, chunk_size=chunk_size).for_model(spec.context_length)
                plans = preview_plans(f, spec, placement, engine.chunk_size, engine.n_ctx(spec.context_length),
                                      sequences=engine.max_running)
    except (GGUFError, SplitError, PlanError, DeviceError) as e:
        fail(str(e))
    out.print(*report.info_tables(mi, model.name, link_gbps), sep="\n")
    defaults = EngineConfig()
    for name, layers, plan in plans:
        out.print(report.plan_table(name, layers, plan, mi.spec.n_experts))
        out.print(report.pool_line(name, plan, defaults.prefix_block_tokens, defaults.cache_ram_gib))

def _int_list(value: str) -> list[int]:
    try:
        items = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not items or any(x < 1 for x in items):
        raise click.BadParameter(f"{value!r}: give positive integers")
    return items


def _warn_cpu_budget(placement) -> None:
    """bench and sweep say so when --max-vram names CPU stages (serve does it with its other warnings)."""
    from strata_mgpu.engine.build import cpu_budget_warning
    from strata_mgpu.stage.device import DeviceError

    try:
        warning = cpu_budget_warning(placement)
    except DeviceError:
        return  # a device that does not exist: the build says so, in one line
    if warning:
        err.print(f"warning: {warning}")


def _placement(devices: str, layer_split: str, max_vram: str | None, dtype: str, cuda_graphs: bool = True,
               prefill_help: bool | None = None, prefill_help_frac: str | None = None,
               resident_experts: int | None = None, threads: int | None = None, cpu_experts: str = "off",
               cache_types: tuple[str, str] = ("bf16", "bf16")):
    from strata_mgpu.config import HostShare, LayerSplit, Placement, parse_cache_type

    budgets: tuple[float | None, ...] = (None,)
    if max_vram:
        try:
            given = tuple(float(x) for x in max_vram.split(","))
        except ValueError:
            fail(f"--max-vram {max_vram!r}: GiB, one value or one per device")
        if any(b < 0.5 for b in given):
            fail(f"--max-vram {max_vram!r}: at least 0.5 GiB a stage")
        budgets = given
    try:
        host_share = HostShare.parse(cpu_experts)
        return Placement.from_env(_env(), prefill_help=prefill_help, prefill_help_frac=prefill_help_frac,
                                  devices=tuple(d.strip() for d in devices.split(",")),
                                  layer_split=LayerSplit.parse(layer_split), max_vram_gib=budgets, dtype=dtype,
                                  cuda_graphs=cuda_graphs, resident_experts=resident_experts, threads=threads,
                                  cpu_experts=host_share,
                                  cache_type_k=parse_cache_type(cache_types[0], "--cache-type-k"),
                                  cache_type_v=parse_cache_type(cache_types[1], "--cache-type-v"))
    except ValueError as e:  # EnvError too: a bad --prefill-help-frac
        fail(str(e))


@main.command(cls=LlamaCppSpellings)
@click.argument("model", type=click.Path(path_type=Path), callback=_model_file)
@click.option("--prompt-tokens", "-p", default="1024,2048,4096,8192", show_default=True,
              help="one-chunk prompt lengths (at most the model's context)")
@click.option("--decode-tokens", "-n", default=64, show_default=True, type=click.IntRange(min=0))
@click.option("--runs", "-r", default=3, show_default=True, type=click.IntRange(min=1), help="median of this many")
@devices_option
@layer_split_option
@max_vram_option
@dtype_option
@click.option("--chunk-size", default=8192, show_default=True, type=click.IntRange(min=1),
              help="longer prompts run in chunks of this many tokens (pipelined across stages)")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="replay batch-1 decode steps as CUDA graphs")
@help_options
@resident_option
@threads_option
@cpu_experts_option
@cache_type_options
@click.option("--server-decode", default=None,
              help="also decode through the engine as the server does (sampling on, seeded), with this many "
                   "concurrent requests each, e.g. 1,8; --decode-tokens tokens a request (64 if 0)")
@click.option("--decode-batch", default="1", show_default=True,
              callback=lambda ctx, param, value: list(dict.fromkeys(_int_list(value))),
              help="also decode this many sequences together, one batched step for all, e.g. 1,8: aggregate "
                   "and per-sequence tok/s for each (--decode-tokens steps, 64 if 0); 1 alone: batch-1 decode only")
@click.option("--decode-context", default=64, show_default=True, type=click.IntRange(min=1),
              help="tokens of the prompt before the batch-1 decode steps (decode reads that much KV a step)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench(model: Path, prompt_tokens: str, decode_tokens: int, runs: int, devices: str, layer_split: str,
          max_vram: str | None, dtype: str, chunk_size: int, cuda_graphs: bool, prefill_help: bool | None,
          prefill_help_frac: str | None, resident_experts: int | None, threads: int | None, cpu_experts: str,
          cache_type_k: str, cache_type_v: str, server_decode: str | None, decode_batch: list[int],
          decode_context: int, json_out: Path | None) -> None:
    """Prefill tok/s against the PCIe link bound, and decode tok/s (at each --decode-batch size)."""
    from strata_mgpu.env import EnvError
    from strata_mgpu.model.spec import spec_from_gguf
    from strata_mgpu.split.runner import SplitError
    from strata_mgpu.stage.device import DeviceError
    from strata_mgpu.tools.bench import decode_batch_kv_tokens, prompts_within, run_bench, write_json

    try:
        with GGUFFile(model) as f:
            lengths, warning = prompts_within(_int_list(prompt_tokens), spec_from_gguf(f).context_length)
    except GGUFError as e:
        fail(str(e))
    if warning:
        err.print(f"warning: {warning}")
    placement = _placement(devices, layer_split, max_vram, dtype, cuda_graphs, prefill_help, prefill_help_frac,
                           resident_experts, threads, cpu_experts, (cache_type_k, cache_type_v))
    _warn_cpu_budget(placement)
    served = _int_list(server_decode) if server_decode else []
    batches = decode_batch if decode_batch != [1] else []
    try:  # KV for the longest prompt and the decode runs (the batch-1 decode's prompt and warm-up steps; the
        # server-shaped run's requests of 32 prompt tokens each, and its warm-up request; the largest decode batch)
        kv = max(max(lengths) + 1, decode_context + decode_tokens + 3,
                 max(served, default=0) * (32 + (decode_tokens or 64)) + 64,
                 max((decode_batch_kv_tokens(b, decode_tokens or 64) for b in batches), default=0))
        runner = _build(model, placement, chunk_size, kv_tokens=kv)
        result = run_bench(runner, model.name, lengths, decode_tokens, runs, chunk_size, on_step=err.print,
                           decode_batches=batches, decode_context=decode_context)
        if server_decode:
            from strata_mgpu.model.tokenizer import tokenizer_from_gguf
            from strata_mgpu.tools.server_decode import measure_server_decode

            tokenizer = tokenizer_from_gguf(GGUFFile(model))
            for n in _int_list(server_decode):
                report_n = measure_server_decode(runner, tokenizer, n, decode_tokens or 64)
                err.print(report_n.summary())
                result.server_decode.append(report_n.as_dict())
    except (GGUFError, DeviceError, SplitError, EnvError) as e:
        fail(str(e))
    out.print(*report.bench_lines(result, chunk_size, max_vram), sep="\n")
    if json_out:
        write_json(result, json_out)


def _build(model: Path, placement, chunk_size: int, kv_tokens: int):
    from rich.progress import MofNCompleteColumn

    from strata_mgpu.engine.build import build_stages
    from strata_mgpu.model.spec import spec_from_gguf

    f = GGUFFile(model)
    spec = spec_from_gguf(f)
    with Progress(TextColumn("[bold]loading[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bar:
        return build_stages(f, spec, placement, chunk_size, kv_tokens=kv_tokens, on_progress=layer_bars(bar))


def _float_list(value: str) -> list[float]:
    try:
        items = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers") from None
    if not items or any(not 0 <= x < 1 for x in items):
        raise click.BadParameter(f"{value!r}: shares lie in [0, 1)")
    return sorted(set(items) | {0.0})


@main.command()
@click.argument("model", type=click.Path(path_type=Path), callback=_model_file)
@devices_option
@layer_split_option
@max_vram_option
@click.option("--prompt-tokens", default="1024,1536,2048,3072,4096,8192", show_default=True)
@click.option("--shares", default="0,0.2,0.3,0.4,0.45,0.5", show_default=True,
              help="helper shares to try; 0 (help off) is always included")
@click.option("--runs", default=3, show_default=True, type=click.IntRange(min=1))
@resident_option
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--png", "png_out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def sweep(model: Path, devices: str, layer_split: str, max_vram: str | None, prompt_tokens: str, shares: str,
          runs: int, resident_experts: int | None, csv_out: Path | None, json_out: Path | None,
          png_out: Path | None) -> None:
    """One-chunk prefill tok/s for each PeerPrefill share and prompt length."""
    from strata_mgpu.env import EnvError
    from strata_mgpu.split.runner import SplitError
    from strata_mgpu.stage.device import DeviceError
    from strata_mgpu.tools import share_sweep as sw

    lengths = _int_list(prompt_tokens)
    share_list = _float_list(shares)
    placement = _placement(devices, layer_split, max_vram, "bf16", prefill_help=True,
                           resident_experts=resident_experts)
    _warn_cpu_budget(placement)
    try:
        runner = _build(model, placement, max(lengths), kv_tokens=max(lengths) + 1)  # its prompts ask for one more
        result = sw.run_sweep(runner, model.name, lengths, share_list, runs,
                              on_cell=lambda c: err.print(sw.describe(c)))
    except (GGUFError, DeviceError, SplitError, EnvError, ValueError) as e:
        fail(str(e))
    out.print(report.sweep_table(result))
    if csv_out:
        sw.write_csv(result, csv_out)
    if json_out:
        sw.write_json(result, json_out)
    if png_out and not sw.write_png(result, png_out):
        err.print("matplotlib is not installed: no PNG written (pip install matplotlib)")


@main.command()
def topo() -> None:
    """Peer-to-peer matrix of the GPUs (nvidia-smi topo -p2p r, checked with CUDA)."""
    from strata_mgpu import topo as t

    raw = t.nvidia_smi_p2p()
    peers = t.cuda_peer_access()
    if raw is None:
        out.print("nvidia-smi not found or failed: no NVIDIA GPU to inspect"
                  + ("" if peers is None else f" (CUDA sees {len({i for i, _ in peers}) or 1} device(s))"))
        return
    try:
        m = t.parse_p2p(raw)
    except t.TopoParseError as e:
        fail(f"could not read nvidia-smi's P2P matrix: {e}")
    cuda = None
    if peers is not None:
        smi_bus_ids, cuda_bus_ids = t.nvidia_smi_bus_ids(), t.cuda_bus_ids()
        if smi_bus_ids is None or cuda_bus_ids is None:
            err.print("nvidia-smi gave no PCI bus ids: CUDA's answers cannot be matched to its GPUs, not shown")
        else:
            try:
                cuda = t.cuda_view(t.parse_smi_bus_ids(smi_bus_ids), cuda_bus_ids, peers)
            except t.TopoParseError as e:
                fail(f"could not read nvidia-smi's PCI bus ids: {e}")
    out.print(*report.topo_lines(m, cuda), sep="\n")

@main.command(cls=LlamaCppSpellings)
@click.argument("model", required=False, type=click.Path(path_type=Path), callback=_model_file)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--ctx-size", "-c", default=None, type=click.IntRange(min=1),
              help="tokens per sequence (default: the model's context length); all sequences share one "
                   "context's KV unless --kv-tokens says more")
@click.option("--chunk-size", default=None, type=click.IntRange(min=1),
              help="prompt tokens per prefill step (default: 8192 on a GPU, 1024 on the CPU, where an 8K chunk takes "
                   "tens of seconds and a request that arrives meanwhile waits for it)")
@click.option("--max-running", "-np", "--parallel", "max_running", default=16, show_default=True,
              type=click.IntRange(min=1), help="sequences decoded together (llama-server's -np)")
@click.option("--arrival-gap-ms", default=2.0, show_default=True, type=click.FloatRange(0, 100),
              help="an idle server's first request waits while more arrive at most this far apart (up to 8 "
                   "gaps), so a burst's prompts run as one prefill; 0: start at once")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="keep conversations' KV blocks so a turn computes only what is new")
@click.option("--cache-ram", "-cram", default="8GiB", show_default=True, metavar="SIZE", callback=_ram_gib,
              help="host RAM for prefix-cache blocks moved out of VRAM, e.g. 8GiB, 8192MiB, 8G; a bare number "
                   "is MiB, as llama-server reads it (at most half the RAM free at start; 0: none)")
@click.option("--kv-tokens", default=None, type=click.IntRange(min=1),
              help="KV cells kept in VRAM for all requests together (default: one --ctx-size); more lets "
                   "long conversations run at once, at the cost of resident experts")
@click.option("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
@click.option("--alias", "-a", default=None, help="model name clients use (default: the file name)")
@click.option("--reasoning-format", type=click.Choice(["deepseek", "none"]), default="deepseek", show_default=True,
              help="deepseek: <think> blocks go to reasoning_content; none: they stay in the content")
@click.option("--tool-call-parser", type=click.Choice(PARSER_NAMES), default="auto",
              show_default=True, help="the tool calls' dialect (vLLM's names): hermes for Qwen3's JSON calls, "
                                      "qwen3_coder for Qwen3-Coder's XML, glm45 for GLM-4.5's, harmony for "
                                      "gpt-oss's; auto: the one the chat template shows")
@click.option("--lenient-json-schema", is_flag=True,
              help="tool arguments and JSON answers may hold keys a schema does not list where it does not say "
                   "additionalProperties (default: they may not)")
@devices_option
@layer_split_option
@max_vram_option
@dtype_option
@help_options
@threads_option
@cpu_experts_option
@cache_type_options
def serve(model: Path | None, host: str, port: int, ctx_size: int | None, chunk_size: int | None, max_running: int,
          arrival_gap_ms: float, prefix_cache: bool, cache_ram: float, kv_tokens: int | None,
          api_key: str | None, alias: str | None, reasoning_format: str, tool_call_parser: str,
          lenient_json_schema: bool, devices: str, layer_split: str,
          max_vram: str | None, dtype: str, prefill_help: bool | None, prefill_help_frac: str | None,
          threads: int | None, cpu_experts: str, cache_type_k: str, cache_type_v: str) -> None:
    """OpenAI-compatible server. With no MODEL, serves a small built-in demo model.

    Ctrl+C or SIGTERM stop it (a load in progress ends after its current layer); the exit status is
    then 128 + the signal's number: 130 after Ctrl+C, 143 after SIGTERM."""
    if api_key is not None and (not api_key or api_key != api_key.strip()):
        # the server compares the stripped bearer token: an empty key would let any empty token in,
        # and a key with spaces around it could never match
        fail(f"--api-key {api_key!r}: give a non-empty key without spaces around it")
    from strata_mgpu.config import EngineConfig, ServerConfig
    from strata_mgpu.env import EnvError
    from strata_mgpu.server import launch
    from strata_mgpu.split.runner import SplitError
    from strata_mgpu.stage.device import DeviceError

    environment = _env()
    try:
        launch.setup_logging(environment.log_level)  # so writing the demo model is seen
        if model is None:
            model = launch.demo_model_path(environment.demo_dir)
            alias = alias or launch.DEMO_NAME
        placement = _placement(devices, layer_split, max_vram, dtype, prefill_help=prefill_help,
                               prefill_help_frac=prefill_help_frac, threads=threads, cpu_experts=cpu_experts,
                               cache_types=(cache_type_k, cache_type_v))
        if chunk_size is None:
            from strata_mgpu.engine.build import default_chunk_size
            chunk_size = default_chunk_size(placement)
        config = ServerConfig(model_path=model, host=host, port=port, api_key=api_key, alias=alias,
                              log_level=environment.log_level, reasoning_format=reasoning_format,
                              tool_call_parser=tool_call_parser, lenient_json_schema=lenient_json_schema,
                              engine=EngineConfig(ctx_size=ctx_size, chunk_size=chunk_size, max_running=max_running,
                                                  arrival_gap_ms=arrival_gap_ms, prefix_cache=prefix_cache,
                                                  cache_ram_gib=cache_ram, kv_tokens=kv_tokens),
                              placement=placement)
        status = launch.serve(config)
    except (GGUFError, EnvError, DeviceError, SplitError, launch.ListenError) as e:
        fail(str(e))
    if status:
        sys.exit(status)


if __name__ == "__main__":
    sys.exit(main())
