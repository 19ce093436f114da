r"""Where a helped one-chunk prompt's time goes on each card: the PeerPrefill helper's diagnosis.

    python3 -m strata_mgpu.tools.profile_helper MODEL.gguf --devices 0,1 --max-vram 16,16 \\
        --resident-experts 0 --tokens 8192 --shares 0,0.45 [--trace-dir DIR]

For each share (0: help off), one prompt runs under torch's profiler after a warm-up; its kernels
and copies are summed per device and stream: busy time, idle gaps inside the busy span (a stream
waiting on an event), hand-over copies, dequantization, GEMMs and uploads. A helped row whose busy
stage's compute stream idles while its upload stream does not is waiting for the helper. The
host's side: its CUDA API calls by name, those that can wait for the device apart, and when it
queued its last call against when the cards finished (just before: the host bound them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# kernel-name fragments -> the category they are summed under (first match wins)
CATEGORIES = (("copy_f32_wide", "hand-over copies"), ("dequant", "dequantize"), ("gemm", "GEMM"),
              ("grouped", "GEMM"), ("cutlass", "GEMM"), ("sm90_", "GEMM"), ("attn", "attention"),
              ("flash", "attention"))


@dataclass
class StreamUse:
    """One stream's GPU work within a window: its intervals merged, and what they ran."""

    device: int
    stream: int
    intervals: list[tuple[float, float]] = field(default_factory=list)  # (start, end) us, merged
    by_category: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # us
    h2d_bytes: int = 0

    @property
    def busy_us(self) -> float:
        return sum(b - a for a, b in self.intervals)

    @property
    def span_us(self) -> float:
        return self.intervals[-1][1] - self.intervals[0][0] if self.intervals else 0.0

    @property
    def gaps(self) -> list[float]:
        """Idle stretches between consecutive intervals (us), inside the busy span."""
        return [b[0] - a[1] for a, b in zip(self.intervals, self.intervals[1:], strict=False)]


def category(name: str, cat: str) -> str:
    if cat == "gpu_memcpy":
        return "host-to-device copies" if "HtoD" in name else "other copies"
    lower = name.lower()
    return next((label for fragment, label in CATEGORIES if fragment in lower), "other kernels")


def stream_use(trace: dict) -> list[StreamUse]:
    """Chrome-trace events of kind kernel / gpu_memcpy / gpu_memset -> per (device, stream) use."""
    raw: dict[tuple[int, int], list[tuple[float, float, str, str, dict]]] = defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = ev.get("args", {})
        key = (int(args.get("device", 0)), int(args.get("stream", 0)))
        start = float(ev["ts"])
        raw[key].append((start, start + float(ev.get("dur", 0.0)), ev.get("name", ""), ev["cat"], args))
    out = []
    for (device, stream), events in sorted(raw.items()):
        use = StreamUse(device, stream)
        for start, end, name, cat, args in sorted(events):
            use.by_category[category(name, cat)] += end - start
            if cat == "gpu_memcpy" and "HtoD" in name:
                use.h2d_bytes += int(args.get("bytes", 0))
            if use.intervals and start <= use.intervals[-1][1]:
                use.intervals[-1] = (use.intervals[-1][0], max(use.intervals[-1][1], end))
            else:
                use.intervals.append((start, end))
        out.append(use)
    return out


# CUDA API calls that can hold the host until the device has caught up
WAITING_CALLS = ("Synchronize", "Free", "Malloc", "MemMap", "MemUnmap", "MemCreate", "MemRelease", "MemSetAccess",
                 "MemAddressFree")
# copies and sets that return only when done (their Async forms do not, to pinned memory)
BLOCKING_COPIES = ("cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyPeer", "cudaMemset", "cuMemcpy", "cuMemcpyHtoD_v2",
                   "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2", "cuMemcpyPeer", "cuMemsetD8_v2", "cuMemsetD32_v2")


def can_wait(name: str) -> bool:
    """Can this CUDA API call hold the host until the device has caught up? (`...Async` ones do not.)"""
    if name in BLOCKING_COPIES:
        return True
    return "Async" not in name and any(w in name for w in WAITING_CALLS)


@dataclass
class HostUse:
    """The host's CUDA API calls within a trace, and when it queued its last one."""

    calls: dict[str, tuple[int, float]]  # name -> (count, total us)
    last_call_end_us: float  # the last call that queues work (not a sync), from the trace's first GPU or API event
    last_gpu_end_us: float

    @property
    def waiting(self) -> dict[str, tuple[int, float]]:
        return {k: v for k, v in self.calls.items() if can_wait(k)}


def host_use(trace: dict) -> HostUse:
    api: list[tuple[float, float, str]] = []
    gpu_end = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        start, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if ev.get("cat") in ("cuda_runtime", "cuda_driver"):
            api.append((start, start + dur, ev.get("name", "")))
        elif ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu_end.append((start, start + dur))
    origin = min([a for a, _, _ in api] + [a for a, _ in gpu_end], default=0.0)
    queued = [b for _, b, name in api if not can_wait(name)]  # a final sync is no work
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for a, b, name in api:
        calls[name][0] += 1
        calls[name][1] += b - a
    return HostUse({k: (int(v[0]), v[1]) for k, v in calls.items()}, max(queued, default=origin) - origin,
                   max((b for _, b in gpu_end), default=origin) - origin)


def describe_host(use: HostUse, top: int = 6) -> list[str]:
    busiest = sorted(use.calls.items(), key=lambda kv: -kv[1][1])[:top]
    lines = [f"  host: queued its last CUDA call at {use.last_call_end_us / 1e3:.1f} ms, the cards finished at "
             f"{use.last_gpu_end_us / 1e3:.1f} ms; calls by time: "
             + ", ".join(f"{k} {n} x {us / 1e3:.1f} ms" for k, (n, us) in busiest)]
    waiting = use.waiting
    lines.append("  host calls that can wait for the device: "
                 + (", ".join(f"{k} {n} x {us / 1e3:.1f} ms" for k, (n, us) in sorted(waiting.items()))
                    if waiting else "none"))
    return lines


def describe(uses: list[StreamUse]) -> list[str]:
    lines = []
    for u in uses:
        gaps = u.gaps
        kinds = sorted(u.by_category.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{what} {us / 1e3:.1f}" for what, us in kinds)
        h2d = f", {u.h2d_bytes / 1e9:.2f} GB up" if u.h2d_bytes else ""
        lines.append(f"  cuda:{u.device} stream {u.stream}: busy {u.busy_us / 1e3:.1f} ms of a "
                     f"{u.span_us / 1e3:.1f} ms span, idle gaps {sum(gaps) / 1e3:.1f} ms "
                     f"(largest {max(gaps, default=0) / 1e3:.2f}){h2d}; ms by kind: {parts}")
    return lines


def host_profile(runner, kv, prompt: torch.Tensor, top: int = 30) -> str:
    """One whole-prompt prefill under cProfile: the host's functions by their own time, and the wall time."""
    import cProfile
    import io
    import pstats

    from strata_mgpu.tools.bench import sync_stages

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    runner.prefill(kv, prompt, whole_prompt=True)
    prof.disable()
    queued = time.perf_counter() - t0
    sync_stages(runner.stages)
    seconds = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return f"  queued in {1e3 * queued:.1f} ms, done in {1e3 * seconds:.1f} ms (under cProfile)\n" + out.getvalue()


def main() -> None:
    from strata_mgpu import env
    from strata_mgpu.config import LayerSplit, Placement
    from strata_mgpu.engine.build import build_stages
    from strata_mgpu.env import default_allocator_config
    from strata_mgpu.model.gguf_reader import GGUFFile
    from strata_mgpu.model.spec import spec_from_gguf
    from strata_mgpu.split.help_rule import HelpPolicy
    from strata_mgpu.split.runner import SplitRunner
    from strata_mgpu.tools.bench import sync_stages

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--max-vram", default="16,16", help="GiB a stage, one value or one per device")
    ap.add_argument("--layer-split", default="auto")
    ap.add_argument("--resident-experts", type=int, default=None, help="force K resident a layer (0: none)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shares", default="0,0.45", help="the helper's shares to profile (0: help off)")
    ap.add_argument("--halves", default=None,
                    help="halves_from values to profile each share with, e.g. 0,1 (0: all rows at once, 1: two "
                         "halves); default: STRATA_HELP_HALVES")
    ap.add_argument("--host", action="store_true",
                    help="instead of the device trace: the host's Python time of one prompt a share (cProfile), "
                         "the functions with the most time of their own")
    ap.add_argument("--trace-dir", type=Path, default=None, help="keep each share's Chrome trace here")
    args = ap.parse_args()
    environment = env.read_or_exit()  # every STRATA_* variable, checked before the model loads
    default_allocator_config()
    f = GGUFFile(args.model)
    spec = spec_from_gguf(f)
    budgets = tuple(float(x) for x in args.max_vram.split(","))
    placement = Placement.from_env(environment, devices=tuple(args.devices.split(",")),
                                   layer_split=LayerSplit.parse(args.layer_split), max_vram_gib=budgets,
                                   resident_experts=args.resident_experts)
    runner = build_stages(f, spec, placement, args.tokens, kv_tokens=args.tokens + 1)
    if not isinstance(runner, SplitRunner) or not runner.helpers:
        raise SystemExit("the helper needs two or more stages (--devices 0,1 or 0,0)")
    stages = runner.stages
    prompt = torch.randint(0, spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    trace_dir = None
    if not args.host:
        trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="strata-helper-"))
        trace_dir.mkdir(parents=True, exist_ok=True)
    halves_values = [None] if args.halves is None else [int(x) for x in args.halves.split(",")]
    for share in (float(s) for s in args.shares.split(",")):
        for halves in halves_values if share > 0 else [None]:  # help off has no halves
            if halves is not None:
                for helper in runner.helpers:
                    helper.halves_from = halves
            runner.policy = HelpPolicy.fixed(share)
            runner.prefill(runner.new_sequence(args.tokens + 1), prompt, whole_prompt=True)  # warm-up
            kv = runner.new_sequence(args.tokens + 1)
            sync_stages(stages)
            label = f"share {share:g}" + ("" if halves is None else f", halves_from {halves}")
            if args.host:
                print(f"{label}: {args.tokens:,} tokens, host time (cProfile)\n{host_profile(runner, kv, prompt)}",
                      flush=True)
                continue
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                runner.prefill(kv, prompt, whole_prompt=True)
                sync_stages(stages)
                seconds = time.perf_counter() - t0
            assert trace_dir is not None  # made above wherever the host alone is not profiled
            path = trace_dir / (f"helper_share_{share:g}" + ("" if halves is None else f"_halves_{halves}") + ".json")
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            print(f"{label}: {args.tokens:,} tokens in {1e3 * seconds:.1f} ms "
                  f"({args.tokens / seconds:,.0f} tok/s, under the profiler); trace {path}")
            print("\n".join(describe(stream_use(trace)) + describe_host(host_use(trace))), flush=True)


if __name__ == "__main__":
    main()
