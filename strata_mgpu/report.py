"""How results are shown in the terminal (rich): `strata info`, `bench`, `sweep` and `topo`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

if TYPE_CHECKING:
    from collections.abc import Callable

    from strata_mgpu.model.info import ModelInfo
    from strata_mgpu.model.spec import RopeScaling
    from strata_mgpu.stage.memory_plan import MemoryPlan
    from strata_mgpu.tools.bench import BenchResult, CpuExpertRate, PrefillResult
    from strata_mgpu.tools.share_sweep import SweepResult
    from strata_mgpu.topo import CudaView, P2PMatrix


def gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def rope_text(r: RopeScaling) -> str:
    """'yarn x4 of 32,768, betas 32/1 (cos/sin x1.139)', 'linear x2 of 4,096', 'none'."""
    if r.kind.value == "none":
        return "none" + (f" (cos/sin x{r.mscale:.4g})" if r.mscale != 1 else "")
    betas = (f", betas {r.beta_fast:g}/{r.beta_slow:g}" + ("" if r.truncate else ", untruncated")
             if r.kind.value == "yarn" else "")
    return (f"{r.kind.value} x{r.factor:g} of {r.original_context:,}" + betas
            + (f" (cos/sin x{r.mscale:.4g})" if r.mscale != 1 else ""))


def info_tables(mi: ModelInfo, name: str, link_gbps: float) -> list[Table]:
    s = mi.spec
    t = Table(title=name, show_header=False, box=None)
    per_layer = mi.expert_bytes_per_layer
    rows = [
        ("architecture", s.arch + (f" ({s.name})" if s.name else "")),
        ("file", f"{gb(mi.file_bytes)} in {mi.n_shards} file(s)"),
        ("layers", str(s.n_layers)),
        ("hidden", str(s.hidden)),
        ("heads / KV heads / head dim", f"{s.n_heads} / {s.n_kv_heads} / {s.head_dim}"),
        ("experts / used / expert FFN", f"{s.n_experts} / {s.n_experts_used} / {s.expert_ffn}"),
        ("vocab", f"{s.vocab_size:,}"),
        ("context", f"{s.context_length:,}"),
        ("RoPE base / RMS eps", f"{s.rope_base:g} / {s.rms_eps:g}"),
        ("RoPE scaling", rope_text(s.rope_scaling)),
        ("output head", "tied to the embedding" if s.tied_output else "own tensor"),
        ("parameters", f"{mi.n_params:,} ({s.n_active_params:,} active per token)"),
        ("expert bytes per layer", gb(per_layer[0]) if len(set(per_layer)) == 1
         else f"{gb(min(per_layer))} .. {gb(max(per_layer))}"),
        ("expert bytes in all", f"{gb(mi.expert_bytes)} ({100 * mi.expert_bytes / mi.tensor_bytes:.1f}% of tensors)"),
        (f"one expert pass at {link_gbps:g} GB/s", f"{mi.expert_pass_seconds(link_gbps) * 1e3:,.1f} ms"),
    ]
    for k, v in rows:
        t.add_row(f"[bold]{k}[/]", v)
    bt = Table(title="bytes by tensor type")
    bt.add_column("type")
    bt.add_column("parameters", justify="right")
    bt.add_column("bytes", justify="right")
    for type_name, nbytes in sorted(mi.bytes_by_type.items(), key=lambda kv: -kv[1]):
        bt.add_row(type_name, f"{mi.params_by_type[type_name]:,}", gb(nbytes))
    mt = Table(title="quant mix by tensor class")
    mt.add_column("class")
    mt.add_column("type")
    mt.add_column("tensors", justify="right")
    mt.add_column("bytes", justify="right")
    for cls, types in mi.quant_mix.items():
        for i, (type_name, count) in enumerate(types.items()):
            mt.add_row(cls if i == 0 else "", type_name, f"{count.tensors:,}", gb(count.nbytes))
    return [t, bt, mt]


def plan_table(device: str, layers: range, plan: MemoryPlan, n_experts: int) -> Table:
    t = Table(title=f"VRAM plan: layers {layers.start}-{layers.stop - 1} on {device}, "
                    f"{plan.resident_per_layer}/{n_experts} experts a layer resident")
    t.add_column("line")
    t.add_column("bytes", justify="right")
    for what, n in plan.lines():
        t.add_row(what, gb(n))
    return t


def pool_line(device: str, plan: MemoryPlan, block_tokens: int, cache_ram_gib: float) -> str:
    """The KV pool a stage's plan makes: its blocks, and the host tier beside it."""
    n = max(1, plan.kv_tokens // block_tokens)
    return (f"KV pool on {device}: {n:,} blocks of {block_tokens} tokens ({plan.kv / n / 2**20:.1f} MiB each, "
            f"{plan.kv_type}), shared by the running sequences and the prefix cache; cached prefixes moved out of "
            f"it in up to {cache_ram_gib:g} GiB of pinned host RAM (--cache-ram)")


def _gb_per_s(x: float | None) -> str:
    """'9.6 GB/s', '0.049 GB/s': two figures at least, so a slow rate does not read 0.0."""
    return "n/a" if x is None else f"{x:.1f} GB/s" if x >= 1 else f"{x:.2g} GB/s"


def _cpu_rates(rates: list[CpuExpertRate], per: str) -> str:
    return ", ".join(f"{'batch 1' if r.rows == 1 else f'{r.rows:,} rows'} {_gb_per_s(r.gb_per_s)} "
                     f"({r.ms_per_call or 0:.3f} ms {per})" for r in rates)


def _narrow_table(title: str, columns: list[str]) -> Table:
    """Right-aligned columns no narrower than their headers' longest word, no vertical rules: eight
    columns fit 80 characters."""
    t = Table(title=title, box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False, min_width=len(title))
    for col in columns:
        t.add_column(col, justify="right", min_width=max(map(len, col.split())))
    return t


def bench_lines(result: BenchResult, chunk_size: int, max_vram: str | None) -> list[Table | str]:
    """What `strata bench` prints: only what applies. A run with no GPU stage has no link (no bound,
    ratio, pinned H2D, VRAM); one that streams no experts has no streamed bytes or compute-alone time."""
    on_gpu = any(st.device.startswith("cuda") for st in result.stages)
    streams = any(st.pass_bytes for st in result.stages)
    link = result.link_gb_per_s is not None
    title = f"{result.model} on {result.device} ({result.kernels})"
    if link:
        title += f", experts {gb(result.expert_bytes)}, pinned H2D {result.link_gb_per_s:.1f} GB/s"

    def sec(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "n/a"

    columns: list[tuple[str, Callable[[PrefillResult], str]]] = [
        ("prompt tokens", lambda r: f"{r.tokens:,}"), ("prefill tok/s", lambda r: f"{r.tok_per_s:,.0f}"),
        ("seconds", lambda r: f"{r.seconds:.3f}")]
    if streams:
        columns.append(("streamed GB", lambda r: f"{r.streamed_bytes / 1e9:.2f}"))
    if link:
        columns.append(("link bound s", lambda r: sec(r.link_bound_s)))
    if streams:
        columns.append(("compute s", lambda r: sec(r.compute_s)))
    if link:
        columns += [("ratio to bound", lambda r: f"{r.ratio_to_bound:.2f}" if r.ratio_to_bound else "n/a"),
                    ("all streamed bound s", lambda r: sec(r.all_streamed_bound_s))]
    t = _narrow_table(title, [name for name, _ in columns])
    for r in result.prefill:
        t.add_row(*(cell(r) for _, cell in columns))
    lines: list[Table | str] = [t]
    if result.decode_tok_per_s is not None:
        hit = (f", {100 * result.decode_resident_share:.0f}% of each layer's experts resident"
               + (" in VRAM" if on_gpu else "") if result.decode_resident_share is not None else "")
        if result.decode_hit_rate is not None:
            hit += f", {100 * result.decode_hit_rate:.0f}% of picks read from {'VRAM' if on_gpu else 'them'}"
        lines.append(f"decode: {result.decode_tok_per_s:.1f} tok/s ({result.decode_tokens} random tokens after a "
                     f"{result.decode_context:,}-token prompt, batch 1{hit})")
        if result.decode_host_ms is not None and on_gpu:  # on the CPU the host's time is all of a step
            step_ms = 1e3 / result.decode_tok_per_s
            lines.append(f"decode host time: {result.decode_host_ms:.2f} ms of each {step_ms:.2f} ms step queues it "
                         f"({100 * result.decode_host_ms / step_ms:.0f}%); the rest the host waits for the device")
    for d in result.decode_batch:
        lo, hi = d.prompt_tokens[0], d.prompt_tokens[-1]
        lines.append(f"decode batch {d.batch}: {d.tok_per_s:,.1f} tok/s in all, {d.per_seq_tok_s:,.1f} per sequence "
                     f"({d.steps} steps of random tokens, prompts of {lo}{'' if lo == hi else f'-{hi}'} tokens)")
    on_host = {cpu.stage for cpu in result.cpu_experts}
    for st in result.stages:
        lines.append(f"stage {st.index}: layers {st.layers} on {st.device}, experts {gb(st.expert_bytes)}, "
                     + ("computed where they lie in host RAM" if st.index in on_host else
                        f"{100 * st.resident_share:.0f}% resident, a pass streams {gb(st.pass_bytes)}")
                     + (f", busy {st.busy_s:.3f} s of the longest prompt" if st.busy_s is not None else ""))
        plan = "VRAM plan" if st.device.startswith("cuda") else "memory plan (host RAM)"
        lines.append(f"  {plan}: " + "; ".join(f"{what} {gb(n)}" for what, n in st.plan if n))
    for served in result.server_decode:
        per = [r["decode_tok_per_s"] for r in served["requests"] if r["decode_tok_per_s"] is not None]
        lines.append(f"server-shaped decode, {served['n_requests']} request(s): "
                     f"{served['steady_tok_per_s'] or 0:.1f} tok/s in all while all decode, "
                     f"{min(per, default=0):.1f}-{max(per, default=0):.1f} each, "
                     f"first token {1e3 * served['mean_ttft_s']:.0f} ms mean")
    for cpu in result.cpu_experts:
        lines.append(f"stage {cpu.stage} experts on the host's cores ({cpu.executor}): "
                     f"{_cpu_rates(cpu.rates, 'a layer') or 'no calls'}")
    for cpu in result.handover:
        lines.append(f"stage {cpu.stage} decode hands {cpu.executor}: "
                     f"{_cpu_rates(cpu.rates, 'a request') or 'no requests'}")
    for i, paths in enumerate(result.paths):
        lines.append(f"stage {i} ran: {paths}")
    if result.overlap_s is not None:
        lines.append(f"stages busy at the same time: {result.overlap_s:.3f} s of {result.pipeline_s:.3f} s "
                     f"({result.pipeline_tokens:,} tokens in chunks of {chunk_size:,})")
    if result.peak_vram_gb is not None:
        live = (f", {result.peak_vram_allocated_gb:.2f} GB in live tensors"
                if result.peak_vram_allocated_gb is not None else "")
        lines.append(f"peak VRAM reserved: {result.peak_vram_gb:.2f} GB{live}"
                     + (f" (budget {max_vram} GiB a stage)" if max_vram else ""))
    return lines


def sweep_table(result: SweepResult) -> Table:
    t = Table(title=f"{result.model} on {result.devices}: one-chunk prefill tok/s (gain over help-off); "
                    f"* best, r = the rule's share; auto: the rate model's pick; bounds: links only")
    t.add_column("tokens", justify="right")
    for s in result.shares():
        t.add_column("off" if s == 0 else f"{s:g}", justify="right")
    t.add_column("rule", justify="right")
    t.add_column("auto", justify="right")
    t.add_column("bound s off / helped", justify="right")
    for n in result.lengths():
        best, rule = result.best_share(n), result.rule_share(n)
        near = min(result.shares(), key=lambda s: abs(s - rule))
        cells = []
        for s in result.shares():
            c = result.cell(n, s)
            mark = ("*" if s == best else "") + ("r" if s == near else "")
            cells.append(f"{c.tok_per_s:,.0f}" + ("" if s == 0 else f" ({100 * result.gain(n, s):+.0f}%)") + mark)
        a, gain, bounds = result.auto_cell(n), result.auto_gain(n), result.bounds(n)
        auto = "n/a" if a is None or gain is None else (
            f"{'/'.join(f'{s:.2f}' for s in dict.fromkeys(a.shares))}: {a.tok_per_s:,.0f} ({100 * gain:+.0f}%)")
        t.add_row(f"{n:,}", *cells, f"{rule:.2f}" if rule else "off", auto,
                  f"{bounds[0]:.3f} / {bounds[1]:.3f}" if bounds else "n/a")
    return t


def topo_lines(m: P2PMatrix, cuda: CudaView | None) -> list[Table | str]:
    from strata_mgpu.topo import LEGEND, runtime_plan

    table = Table(title="P2P read capability (nvidia-smi topo -p2p r)")
    table.add_column("")
    for g in m.gpus:
        table.add_column(g, justify="center")
    for i, g in enumerate(m.gpus):
        table.add_row(g, *[m.status[i, j] for j in range(len(m.gpus))])
    lines: list[Table | str] = [table]
    if cuda is not None:
        lines += [f"{g} is cuda:{cuda.ordinals[i]}" if i in cuda.ordinals else f"{g} is hidden from CUDA "
                  f"(CUDA_VISIBLE_DEVICES)" for i, g in enumerate(m.gpus)]
    if len(m.gpus) == 1:
        lines.append("one GPU: nothing to hand over between cards")
    for i, j, code in m.pairs():
        checked = ""
        if cuda is not None and (i, j) in cuda.peers:
            checked = f"; CUDA peer access {'yes' if cuda.peers[i, j] else 'no'}"
            if cuda.peers[i, j] != (code == "OK"):
                checked += " (disagrees with nvidia-smi)"
        lines.append(f"{m.gpus[i]} -> {m.gpus[j]}: {code} ({LEGEND[code]}){checked}: {runtime_plan(code)}")
    return lines
