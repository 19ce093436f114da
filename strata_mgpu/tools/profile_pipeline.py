r"""Why do the stages of a split overlap so little on a long prompt? One chunked prompt through a
split, with each stage's enqueue timed on the host and its work timed on the device, the
allocator's retries and frees counted, and the CUDA runtime calls that can block the host listed.

    python3 -m strata_mgpu.tools.profile_pipeline MODEL.gguf --devices 0,1 --max-vram 16,16 \\
        [--tokens 32768] [--chunk 8192] > pipeline.txt

If stage k's host enqueue of chunk c lasts about as long as its device work, something in it
waits for the device, and stage k+1's enqueue cannot start early.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from strata_mgpu import env
from strata_mgpu.config import Placement
from strata_mgpu.engine.build import build_stages
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.split.runner import SplitRunner
from strata_mgpu.tools.bench import StageTimeline, busy_and_overlap, prefill_chunks, sync_stages

# CUDA runtime/driver calls that may make the host wait for the device
BLOCKING = ("cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaFreeHost", "cudaStreamSynchronize",
            "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cuMemFree", "cuMemAlloc",
            "cudaHostRegister", "cudaHostUnregister", "cuMemUnmap", "cuMemMap", "cuMemCreate", "cuMemRelease")
STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


class HostTimeline:
    """Host perf_counter at each stage's start and end hook, beside the device events."""

    def __init__(self, device_timeline: StageTimeline):
        self.device = device_timeline
        self.t0 = time.perf_counter()
        self.marks: list[tuple[int, str, float]] = []

    def __call__(self, k: int, what: str) -> None:
        self.marks.append((k, what, time.perf_counter() - self.t0))
        self.device(k, what)


def allocator_stats(devices: list[torch.device]) -> dict[torch.device, dict[str, int]]:
    return {d: {k: int(torch.cuda.memory_stats(d).get(k, 0)) for k in STATS} for d in set(devices)
            if d.type == "cuda"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--devices", default="0,0")
    ap.add_argument("--max-vram", default="16,16")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    args = ap.parse_args()
    environment = env.read_or_exit()  # every STRATA_* variable, checked before the model loads
    f = GGUFFile(args.model)
    spec = spec_from_gguf(f)
    budgets = tuple(float(x) for x in args.max_vram.split(","))
    placement = Placement.from_env(environment, prefill_help=False, devices=tuple(args.devices.split(",")),
                                   max_vram_gib=budgets)
    runner = build_stages(f, spec, placement, args.chunk, kv_tokens=args.tokens + 1)
    if not isinstance(runner, SplitRunner):
        raise SystemExit("the pipeline needs two or more stages (--devices 0,1 or 0,0)")
    stages = runner.stages
    devices = [s.ctx.device for s in stages]
    prompt = torch.randint(0, spec.vocab_size, (args.tokens,))
    prefill_chunks(runner, prompt, args.chunk)  # warm-up: kernels, allocator
    sync_stages(stages)
    before = allocator_stats(devices)
    host = HostTimeline(StageTimeline(stages))
    runner.on_stage = host
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        prefill_chunks(runner, prompt, args.chunk)
        enqueued = time.perf_counter() - t0
        sync_stages(stages)
        wall = time.perf_counter() - t0
    runner.on_stage = None
    after = allocator_stats(devices)
    print(f"{args.tokens} tokens in chunks of {args.chunk} on {args.devices} ({args.max_vram} GiB): "
          f"{wall:.3f} s wall, the host had queued everything after {enqueued:.3f} s")
    intervals = host.device.intervals()
    busy, overlap, span = busy_and_overlap(intervals)
    print(f"device: busy {', '.join(f'stage {k} {b:.3f} s' for k, b in busy.items())}; both at once {overlap:.3f} s "
          f"of {span:.3f} s")
    print("per chunk: stage, host enqueue [start, end] s, device work [start, end] s")
    host_iv: dict[int, list[tuple[float, float]]] = {}
    starts: dict[int, float] = {}
    for k, what, t in host.marks:
        if what == "start":
            starts[k] = t
        else:
            host_iv.setdefault(k, []).append((starts.pop(k), t))
    for c in range(max(len(v) for v in host_iv.values())):
        for k in sorted(host_iv):
            if c < len(host_iv[k]):
                (ha, hb), (da, db) = host_iv[k][c], intervals[k][c]
                print(f"  chunk {c} stage {k}: host [{ha:7.3f}, {hb:7.3f}] ({hb - ha:.3f}), "
                      f"device [{da:7.3f}, {db:7.3f}] ({db - da:.3f})")
    for d in after:
        delta = {k: after[d][k] - before[d][k] for k in STATS}
        print(f"allocator on {d}: " + ", ".join(f"{k} {v}" for k, v in delta.items()))
    rows = [e for e in prof.key_averages() if e.key.startswith(BLOCKING)]
    rows.sort(key=lambda e: -e.cpu_time_total)
    print("host calls that may wait for the device (count, total ms):")
    for e in rows[:15]:
        print(f"  {e.key:32s} {e.count:6d} {e.cpu_time_total / 1e3:9.1f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
