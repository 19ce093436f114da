"""`strata bench`: one-chunk prefill and decode speed against the link bound, in one run.

Measures pinned host-to-device bandwidth first (the bound's denominator), then for each prompt
length: prefill tok/s, achieved expert GB/s (every expert byte crosses the link once per
prefill), the link bound (expert bytes / measured bandwidth) and the ratio to it; then decode
tok/s. Runs on the CPU with the tiny model too (bandwidth then reads 'n/a').
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from strata_mgpu.runtime.stage import Stage


@dataclass
class PrefillResult:
    tokens: int
    seconds: float  # median over runs
    tok_per_s: float
    expert_gb_per_s: float
    bound_s: float | None  # expert bytes / measured link bandwidth
    ratio_to_bound: float | None  # bound_s / seconds: 1.0 is the link's speed
    runs: list[float] = field(default_factory=list)


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
    peak_vram_gb: float | None
    max_vram_gib: float | None
    kernels: str
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d"))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_h2d(stage: Stage, repeats: int = 5) -> float | None:
    """Pinned host-to-device GB/s, copying the largest arena layer (what the ring does)."""
    if not stage.ctx.is_cuda:
        return None
    src = stage.arena.layer(max(stage.arena.layouts, key=lambda i: stage.arena.layer(i).numel()))
    dst = torch.empty_like(src, device=stage.ctx.device)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() / statistics.median(times[1:]) / 1e9


def time_prefill(stage: Stage, tokens: int, runs: int, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, stage.spec.vocab_size, (tokens,), generator=g)
    out = []
    for _ in range(runs):
        kv = stage.new_sequence(tokens + 1)
        _sync(stage.ctx.device)
        t0 = time.perf_counter()
        stage.prefill(kv, prompt)
        _sync(stage.ctx.device)
        out.append(time.perf_counter() - t0)
    return out


def time_decode(stage: Stage, n: int, prompt_tokens: int = 64) -> float:
    """Decode tok/s at batch 1, greedy, one token at a time."""
    kv = stage.new_sequence(prompt_tokens + n + 3)  # + the two warm-up steps
    logits = stage.prefill(kv, torch.arange(prompt_tokens) % stage.spec.vocab_size)
    token = torch.tensor([int(logits.argmax())])
    for _ in range(2):  # warm the expert cache and the kernels
        logits = stage.decode([kv], token)
        token = torch.tensor([int(logits[0].argmax())])
    _sync(stage.ctx.device)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = stage.decode([kv], token)
        token = torch.tensor([int(logits[0].argmax())])  # the host needs each token: a sync per step
    return n / (time.perf_counter() - t0)


def run_bench(stage: Stage, model_name: str, prompt_tokens: list[int], decode_tokens: int, runs: int,
              max_vram_gib: float | None, on_step: Callable[[str], None] = lambda s: None) -> BenchResult:
    bw = measure_h2d(stage)
    on_step(f"pinned H2D: {bw:.1f} GB/s" if bw else "pinned H2D: n/a (CPU)")
    expert_bytes = stage.arena.nbytes
    time_prefill(stage, min(prompt_tokens), 1)  # warm-up: kernel compilation, allocator
    if stage.ctx.is_cuda:
        torch.cuda.reset_peak_memory_stats(stage.ctx.device)
    results = []
    for n in prompt_tokens:
        times = time_prefill(stage, n, runs)
        med = statistics.median(times)
        bound = expert_bytes / (bw * 1e9) if bw else None
        results.append(PrefillResult(tokens=n, seconds=med, tok_per_s=n / med, expert_gb_per_s=expert_bytes / med / 1e9,
                                     bound_s=bound, ratio_to_bound=bound / med if bound else None, runs=times))
        on_step(f"prefill {n}: {n / med:,.0f} tok/s")
    dec = time_decode(stage, decode_tokens) if decode_tokens else None
    cache = stage.model.experts.cache
    peak = torch.cuda.max_memory_reserved(stage.ctx.device) / 1e9 if stage.ctx.is_cuda else None
    return BenchResult(device=str(stage.ctx.device), model=model_name, expert_bytes=expert_bytes, link_gb_per_s=bw,
                       prefill=results, decode_tokens=decode_tokens, decode_tok_per_s=dec,
                       decode_resident_share=cache.hit_rate_uniform if cache else None, peak_vram_gb=peak,
                       max_vram_gib=max_vram_gib, kernels=stage.report.kernels)


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(result.to_json())
