"""`strata bench`: prefill and decode speed against the link bound, in one run.

The bound of a prompt is the larger of the link bound (streamed bytes / measured pinned
bandwidth: the busiest link's where chunks pipeline across stages; for a one-chunk prompt on a
split, the stages one after the other, each with the share its helper took) and the compute of
the same passes timed without their uploads. Every non-resident expert byte crosses a link once
per chunk. Prompts longer than the chunk size run chunk by chunk, as the engine runs them. On the
CPU there is no link: no bandwidth, no link bound.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from strata_mgpu.kernels.cpu_experts import ExpertRate
from strata_mgpu.model.kv_pool import DEFAULT_BLOCK_TOKENS
from strata_mgpu.split.runner import SplitRunner
from strata_mgpu.stage.experts.cache import vram_share
from strata_mgpu.stage.experts.cpu_handover import CpuHandover
from strata_mgpu.stage.experts.host_cores import HostCoreExperts
from strata_mgpu.stage.experts.ring import ExpertRing, Slot
from strata_mgpu.stage.experts.streamed import StreamedExperts
from strata_mgpu.stage.stage import Stage
from strata_mgpu.stage.streams import Mark

Runner = Stage | SplitRunner  # what bench measures: one stage, or stages in a split


@dataclass
class PrefillResult:
    tokens: int
    seconds: float  # median over runs
    tok_per_s: float
    expert_gb_per_s: float  # expert bytes that crossed the links per second
    streamed_bytes: int  # expert bytes the prompt streamed (non-resident experts, every chunk)
    link_bound_s: float | None  # chunks x the busiest link's streamed bytes / measured bandwidth; one chunk on
    # a split: the stages one after the other, each helped or not (`split_one_chunk_bound`)
    compute_s: float | None  # the same passes timed without their uploads (median)
    bound_s: float | None  # the larger of the two: what the prompt cannot beat
    ratio_to_bound: float | None  # bound_s / seconds: 1.0 is as fast as the bound allows
    all_streamed_bound_s: float | None  # the link bound were every expert streamed (older figures' bound)
    runs: list[float] = field(default_factory=list)


@dataclass
class StageResult:
    index: int
    device: str
    layers: str
    expert_bytes: int
    resident_share: float  # of each layer's experts, resident in VRAM (computed in place)
    pass_bytes: int  # expert bytes one prompt pass streams over this stage's link
    plan: list[tuple[str, int]]  # the stage's VRAM plan, line by line
    busy_s: float | None  # during the longest prompt, when it ran in several chunks


@dataclass
class DecodeBatchResult:
    batch: int  # sequences decoded together, one runner.decode call a step
    steps: int  # timed steps (each gives every sequence one token)
    prompt_tokens: list[int]  # each sequence's prompt: different lengths, so the rows sit at different positions
    tok_per_s: float  # aggregate: batch * steps / seconds
    per_seq_tok_s: float  # each sequence's: steps / seconds


@dataclass
class CpuExpertRate:
    rows: int  # rows a call: 1 for a batch-1 decode step, a prompt's chunk, a decode batch
    calls: int  # layer calls with that many rows, since the warm-up
    gb_per_s: float | None  # distinct picked experts' bytes over the calls' wall time
    ms_per_call: float | None  # one layer's picks


@dataclass
class CpuExpertsResult:
    stage: int
    executor: str  # 'ggml on 2 threads', or the torch twin's name
    rates: list[CpuExpertRate] = field(default_factory=list)


@dataclass
class BenchResult:
    device: str
    model: str
    expert_bytes: int
    link_gb_per_s: float | None
    prefill: list[PrefillResult]
    decode_tokens: int
    decode_tok_per_s: float | None
    decode_resident_share: float | None  # share of each layer's experts resident in VRAM for decode
    decode_hit_rate: float | None  # share of the timed decode steps' expert picks read from VRAM
    peak_vram_gb: float | None  # reserved by the caching allocator (what the budget caps)
    peak_vram_allocated_gb: float | None  # in live tensors; reserved minus this is cached free blocks
    kernels: str
    paths: list[str] = field(default_factory=list)  # per stage: which implementation each op ran, and how often
    stages: list[StageResult] = field(default_factory=list)
    overlap_s: float | None = None  # time two or more stages were busy at once (longest prompt)
    pipeline_s: float | None = None
    pipeline_tokens: int | None = None
    server_decode: list[dict] = field(default_factory=list)  # tools.server_decode reports, when asked for
    decode_batch: list[DecodeBatchResult] = field(default_factory=list)  # --decode-batch sizes other than 1 alone
    decode_host_ms: float | None = None  # batch 1: the host's time to queue a step (the rest it waits on the device)
    decode_context: int = 64  # batch 1: the prompt's tokens before the timed steps
    cpu_experts: list[CpuExpertsResult] = field(default_factory=list)  # stages whose experts run on the host's cores
    # GPU stages handing a share of decode's missing experts to the host's cores: each request's wall
    # time, from the worker seeing it to its answer (stage.experts.handover), over the timed decode
    handover: list[CpuExpertsResult] = field(default_factory=list)
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d"))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def cpu_rates(stage: int, executor: str, rates: dict[int, ExpertRate]) -> CpuExpertsResult:
    """A stage's host-core rates (an executor's, or its hand-over worker's), by rows a call."""
    return CpuExpertsResult(stage=stage, executor=executor, rates=[
        CpuExpertRate(rows=rows, calls=r.calls, gb_per_s=r.gb_per_s, ms_per_call=r.ms_per_call)
        for rows, r in sorted(rates.items())])


def sync_stages(stages: list[Stage]) -> None:
    for ctx in {s.ctx.device: s.ctx for s in stages}.values():
        ctx.synchronize_device()


def measure_h2d(stage: Stage, repeats: int = 5) -> float | None:
    """Pinned host-to-device GB/s, copying the largest arena layer (what the ring does)."""
    if not stage.ctx.is_cuda:
        return None
    src = stage.arena.layer(max(stage.arena.layouts, key=lambda i: stage.arena.layer(i).numel()))
    dst = torch.empty_like(src, device=stage.ctx.device)
    times = []
    for _ in range(repeats + 1):
        start = stage.ctx.mark()
        dst.copy_(src, non_blocking=True)
        times.append(stage.ctx.mark().seconds_since(start))
    return src.numel() / statistics.median(times[1:]) / 1e9


def prefill_chunks(runner, prompt: torch.Tensor, chunk: int, kv=None) -> torch.Tensor:
    """`prompt` into `kv` (a new sequence if None) chunk by chunk, as the engine prefills: no host
    sync between chunks; the last chunk's logits."""
    kv = runner.new_sequence(prompt.numel() + 1) if kv is None else kv
    whole = prompt.numel() <= chunk
    for start in range(0, prompt.numel(), chunk):
        logits = runner.prefill(kv, prompt[start:start + chunk], whole_prompt=whole,
                                want_logits=start + chunk >= prompt.numel())
    return logits


class UntimedPrompts:
    """A `split.runner.PromptTimer` that times nothing, so the helper policy learns nothing."""

    def start(self, tokens: int) -> None:
        pass

    def stop(self) -> None:
        pass

    def read(self) -> tuple[int, float] | None:
        return None


@contextlib.contextmanager
def uploads_skipped(stages: list[Stage]) -> Iterator[None]:
    """Every ring's uploads take their slot with nothing copied, so a pass computes from whatever the
    slots hold (wrong answers): the compute a pass cannot go below, its links out of the way."""
    rings = [s.experts.ring for s in stages if s.experts.ring is not None]

    def nothing_copied(ring: ExpertRing) -> Callable[[int, Sequence[torch.Tensor]], Slot]:
        return lambda layer, runs: ring.advance()

    for ring in rings:  # an instance attribute, over the class's method until deleted
        ring.upload = nothing_copied(ring)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for ring in rings:
            del ring.upload


@contextlib.contextmanager
def unobserved(runner: Runner) -> Iterator[None]:
    if not isinstance(runner, SplitRunner):
        yield
        return
    clock, runner.prompt_clock = runner.prompt_clock, UntimedPrompts()
    try:
        yield
    finally:
        runner.prompt_clock = clock


def time_compute(runner: Runner, tokens: int, runs: int, chunk: int) -> list[float]:
    """Prefill timed with every ring's uploads skipped (`uploads_skipped`)."""
    with uploads_skipped(runner.stages), unobserved(runner):
        return time_prefill(runner, tokens, runs, chunk)


def time_prefill(runner, tokens: int, runs: int, chunk: int, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, runner.spec.vocab_size, (tokens,), generator=g)
    out = []
    for _ in range(runs):
        sync_stages(runner.stages)
        t0 = time.perf_counter()
        prefill_chunks(runner, prompt, chunk)
        sync_stages(runner.stages)
        out.append(time.perf_counter() - t0)
    return out


class StageTimeline:
    """Busy intervals of each stage, from marks recorded on its stream (host clock on the CPU)."""

    def __init__(self, stages: list[Stage]):
        self.stages = stages
        self.marks: list[tuple[int, str, Mark]] = []
        self.base = {s.ctx.device: s.ctx.mark() for s in stages}

    def __call__(self, k: int, what: str) -> None:
        self.marks.append((k, what, self.stages[k].ctx.mark()))

    def intervals(self) -> dict[int, list[tuple[float, float]]]:
        def at(k: int, mark: Mark) -> float:
            return mark.seconds_since(self.base[self.stages[k].ctx.device])

        out: dict[int, list[tuple[float, float]]] = {k: [] for k in range(len(self.stages))}
        starts: dict[int, float] = {}
        for k, what, mark in self.marks:
            if what == "start":
                starts[k] = at(k, mark)
            else:
                out[k].append((starts.pop(k), at(k, mark)))
        return out


def busy_and_overlap(intervals: dict[int, list[tuple[float, float]]]) -> tuple[dict[int, float], float, float]:
    busy = {k: sum(b - a for a, b in iv) for k, iv in intervals.items()}
    edges = sorted([(a, 1) for iv in intervals.values() for a, _ in iv] + [(b, -1) for iv in intervals.values()
                                                                            for _, b in iv])
    overlap, active, last = 0.0, 0, None
    for t, d in edges:
        if last is not None and active >= 2:
            overlap += t - last
        active += d
        last = t
    span = (edges[-1][0] - edges[0][0]) if edges else 0.0
    return busy, overlap, span


class DecodeTiming(NamedTuple):
    tok_per_s: float
    hit_rate: float | None  # share of the timed steps' expert picks read from VRAM (None: no expert cache)
    issue_ms: float  # host time a step takes to be queued (`runner.decode` until it returns, before the sync)


def time_decode(runner, n: int, prompt_tokens: int = 64, seed: int = 0, chunk: int = 8192) -> DecodeTiming:
    """Decode tok/s at batch 1, the share of picks read from VRAM, and the host's time to queue a step.
    The next token fed is random: a synthetic model's greedy chain soon loops over a few tokens,
    whose experts the cache then holds, which would flatter the figure."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, runner.spec.vocab_size, (prompt_tokens + n + 2,), generator=g)
    kv = runner.new_sequence(prompt_tokens + n + 3)  # + the two warm-up steps
    prefill_chunks(runner, tokens[:prompt_tokens], chunk, kv)
    steps = iter(tokens[prompt_tokens:].view(-1, 1))
    for _ in range(2):  # warm up: kernels, graph capture
        int(runner.decode([kv], next(steps))[0].argmax())
    caches = [s.experts.cache for s in runner.stages if s.experts.cache is not None]
    sync_stages(runner.stages)
    before = [c.tally() for c in caches]
    t0 = time.perf_counter()
    issue = 0.0
    for _ in range(n):
        t = time.perf_counter()
        logits = runner.decode([kv], next(steps))
        issue += time.perf_counter() - t
        int(logits[0].argmax())  # the host needs each step's logits
    seconds = time.perf_counter() - t0
    after = [c.tally() for c in caches]  # each pick counted under the residency of when its flush landed
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    total = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return DecodeTiming(n / seconds, vram_share(caches, hits, total), 1e3 * issue / n)


def decode_batch_prompts(batch: int, prompt_tokens: int = 64, step: int = 7) -> list[int]:
    return [prompt_tokens + step * b for b in range(batch)]


def decode_batch_kv_tokens(batch: int, n_steps: int, warmup: int = 2) -> int:
    """KV cells `time_decode_batch` takes for all its sequences together (a runner plans for this), each
    in whole blocks of the pool."""
    b = DEFAULT_BLOCK_TOKENS
    return sum(-(-(n + warmup + n_steps + 1) // b) * b for n in decode_batch_prompts(batch))


def time_decode_batch(runner, batch: int, n_steps: int, warmup: int = 2, chunk: int = 8192, seed: int = 0
                      ) -> tuple[float, float]:
    """Aggregate and per-sequence decode tok/s of `batch` sequences of different prompt lengths,
    random tokens fed as in `time_decode`; the warm-up steps are not timed."""
    g = torch.Generator().manual_seed(seed)
    kvs, first = [], []
    for n in decode_batch_prompts(batch):
        kv = runner.new_sequence(n + warmup + n_steps + 1)
        logits = prefill_chunks(runner, torch.randint(0, runner.spec.vocab_size, (n,), generator=g), chunk, kv)
        kvs.append(kv)
        first.append(logits.argmax(-1).view(1))
    tokens = torch.cat(first).cpu()
    for _ in range(warmup):
        tokens = runner.decode(kvs, tokens).argmax(-1).cpu()
    sync_stages(runner.stages)
    t0 = time.perf_counter()
    for _ in range(n_steps):
        runner.decode(kvs, tokens).argmax(-1).cpu()  # the host waits for each step's tokens, as sampling does
        # random tokens fed, as `time_decode` does: a synthetic model's greedy chain loops over a few
        # tokens, which would flatter a partly resident expert cache
        tokens = torch.randint(0, runner.spec.vocab_size, (batch,), generator=g)
    sync_stages(runner.stages)
    seconds = time.perf_counter() - t0
    return batch * n_steps / seconds, n_steps / seconds


def _early_ring_bytes(stage: Stage, earlier: list[Stage]) -> float:
    """What `stage`'s ring may take in while the `earlier` stages run: all it holds where one of them
    is on another card (over-counting only loosens a lower bound)."""
    ring = stage.experts.ring
    before = any(s.ctx.device != stage.ctx.device for s in earlier)
    return float(ring.nbytes) if before and ring is not None else 0.0


def split_one_chunk_bound(runner, tokens: int) -> float | None:
    """The link bound of the split's last one-chunk prompt of `tokens`, with the share each busy
    stage's helper took then; None where a stage's link was never probed."""
    from strata_mgpu.split.rate_model import one_chunk_link_bound, stage_load

    stages: list[Stage] = runner.stages
    parts = []
    for k, busy in enumerate(stages):
        idle = stages[(k + 1) % len(stages)]
        load = stage_load(busy, idle)
        if load.link_busy is None or load.link_helper is None:
            return None
        streamed = busy.experts.streamed_per_layer()
        helped = runner.last_help[k] if k < len(runner.last_help) else 0
        parts.append((load, helped / streamed if streamed else 0.0, idle.ctx.device != busy.ctx.device,
                      _early_ring_bytes(busy, stages[:k]), _early_ring_bytes(idle, stages[:k])))
    return one_chunk_link_bound(parts, tokens)


def prompts_within(lengths: list[int], context: int) -> tuple[list[int], str | None]:
    """The prompt lengths a model of `context` tokens can run (longer ones cut to the context), and
    the warning that says so (None where all fit)."""
    fitted = list(dict.fromkeys(min(n, context) for n in lengths))
    longer = [n for n in lengths if n > context]
    if not longer:
        return fitted, None
    return fitted, (f"--prompt-tokens {','.join(map(str, longer))}: more than the model's context of {context:,} "
                    f"tokens; benched at {context:,}")


def run_bench(runner, model_name: str, prompt_tokens: list[int], decode_tokens: int, runs: int, chunk: int,
              on_step: Callable[[str], None] = lambda s: None, decode_batches: list[int] | None = None,
              decode_context: int = 64) -> BenchResult:
    """`decode_batches`: batch sizes for `time_decode_batch` (--decode-tokens steps each, 64 if 0);
    none, or batch 1 alone, times only `time_decode`, after `decode_context` tokens."""
    stages: list[Stage] = runner.stages
    bw = measure_h2d(stages[0])
    if bw:  # a CPU stage has no link to measure
        on_step(f"pinned H2D: {bw:.1f} GB/s")
    expert_bytes = sum(s.arena.nbytes for s in stages)
    per_link: dict[torch.device, int] = {}  # bytes a pass streams over each card's link (stages on one card share it)
    all_per_link: dict[torch.device, int] = {}
    for s in stages:
        per_link[s.ctx.device] = per_link.get(s.ctx.device, 0) + s.experts.pass_bytes()
        all_per_link[s.ctx.device] = all_per_link.get(s.ctx.device, 0) + s.arena.nbytes
    pass_bytes = sum(per_link.values())
    time_prefill(runner, min(min(prompt_tokens), chunk), 1, chunk)  # warm-up: kernels, allocator
    host = {i: s.experts.executor for i, s in enumerate(stages) if isinstance(s.experts, HostCoreExperts)}
    for executor in host.values():
        executor.reset_rates()
    for d in {s.ctx.device for s in stages if s.ctx.is_cuda}:
        torch.cuda.reset_peak_memory_stats(d)
    results = []
    for n in prompt_tokens:
        times = time_prefill(runner, n, runs, chunk)
        med = statistics.median(times)
        passes = -(-n // chunk)  # every chunk streams every non-resident expert once
        link = passes * max(per_link.values()) / (bw * 1e9) if bw else None  # chunks pipeline: the busiest link
        if bw and passes == 1 and len(stages) > 1:  # one chunk: the stages one after the other, helped or not
            link = split_one_chunk_bound(runner, n)
        compute = statistics.median(time_compute(runner, n, runs, chunk))
        bound = max(link, compute) if link is not None and compute is not None else None
        results.append(PrefillResult(
            tokens=n, seconds=med, tok_per_s=n / med, expert_gb_per_s=passes * pass_bytes / med / 1e9,
            streamed_bytes=passes * pass_bytes, link_bound_s=link, compute_s=compute, bound_s=bound,
            ratio_to_bound=bound / med if bound else None,
            all_streamed_bound_s=passes * max(all_per_link.values()) / (bw * 1e9) if bw else None, runs=times))
        on_step(f"prefill {n}: {n / med:,.0f} tok/s" + (f" (compute alone {compute:.3f} s)" if pass_bytes else ""))
    busy: dict[int, float] = {}
    overlap = span = None
    longest = max(prompt_tokens)
    if len(stages) > 1 and longest > chunk:
        timeline = StageTimeline(stages)
        runner.on_stage = timeline
        try:
            time_prefill(runner, longest, 1, chunk)
        finally:
            runner.on_stage = None
        busy, overlap, span = busy_and_overlap(timeline.intervals())
    handing = {i: s.experts.handover for i, s in enumerate(stages)
               if isinstance(s.experts, StreamedExperts) and isinstance(s.experts.handover, CpuHandover)}
    for h in handing.values():
        h.worker.counter.reset_rates()
    dec = time_decode(runner, decode_tokens, prompt_tokens=decode_context, chunk=chunk) if decode_tokens else None
    handed = [cpu_rates(i, h.describe(), h.worker.counter.rates) for i, h in handing.items()]
    batched = []
    for b in decode_batches if decode_batches and decode_batches != [1] else []:
        steps = decode_tokens or 64
        total, each = time_decode_batch(runner, b, steps, chunk=chunk)
        batched.append(DecodeBatchResult(batch=b, steps=steps, prompt_tokens=decode_batch_prompts(b),
                                         tok_per_s=total, per_seq_tok_s=each))
        on_step(f"decode batch {b}: {total:,.1f} tok/s in all, {each:,.1f} per sequence")
    cache = stages[0].experts.cache
    devices = {s.ctx.device for s in stages if s.ctx.is_cuda}
    peak = sum(torch.cuda.max_memory_reserved(d) for d in devices) / 1e9 if devices else None
    peak_live = sum(torch.cuda.max_memory_allocated(d) for d in devices) / 1e9 if devices else None
    return BenchResult(
        device=",".join(str(s.ctx.device) for s in stages), model=model_name, expert_bytes=expert_bytes,
        link_gb_per_s=bw, prefill=results, decode_tokens=decode_tokens, decode_context=decode_context,
        decode_tok_per_s=dec.tok_per_s if dec else None, decode_host_ms=dec.issue_ms if dec else None,
        decode_resident_share=cache.hit_rate_uniform if cache else None,
        decode_hit_rate=dec.hit_rate if dec else None, peak_vram_gb=peak,
        peak_vram_allocated_gb=peak_live,
        kernels=stages[0].report.kernels, paths=[s.kernels.path_summary() for s in stages],
        stages=[StageResult(index=i, device=str(s.ctx.device), layers=f"{s.layers.start}-{s.layers.stop - 1}",
                            expert_bytes=s.arena.nbytes, resident_share=s.plan.resident_share,
                            pass_bytes=s.experts.pass_bytes(), plan=s.plan.lines(), busy_s=busy.get(i))
                for i, s in enumerate(stages)],
        overlap_s=overlap, pipeline_s=span, pipeline_tokens=longest if overlap is not None else None,
        decode_batch=batched, handover=handed,
        cpu_experts=[cpu_rates(i, x.describe(), x.rates) for i, x in host.items()])


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(result.to_json())
