"""A CPU stage's decode on cores it shares with busy processes: tok/s for each number of busy
spinners beside it, for each fixed thread count and for the adaptive executor.

    python -m strata_mgpu.tools.shared_host [MODEL.gguf] [--preset small] [--cores 0-3]
        [--busy 0,1,2,4] [--threads 1,2,3,4] [--warmup 1] [--seconds 2] [--json OUT]

The stage, its threads and every spinner (`while True: pass`, a process each) are confined to
`--cores` (default: the cores this process may use), so the spinners take cores from the stage as
another process on a shared host would. Without a model file the preset is written to a temporary
file first. A cell decodes one sequence, a token at a time, for `--warmup` seconds untimed (the
adaptive executor settles on its count there) and `--seconds` timed, at least two steps; the
adaptive cell also reports the mean threads it computed on; every cell the run-queue wait of the
process's threads over its timed stretch (the adaptive policy's signal: threads waiting for a core
on average, and the wait a slice). After the last row the spinners stop
and the adaptive executor's climb back to every thread is timed (`recovery_s`). Columns: each of
`--threads` fixed (STRATA_ADAPT_THREADS=0 alike; torch's intra-op threads at the same count), then
`adaptive`; `--torch-threads cores` leaves torch on every core instead (the rule before the
executor set them; fixed columns only). Default cells: busy 0, 1, half the cores and all of them;
threads 1 to the cores (beyond 8 cores: 1, 2 and each quarter); about 3 s a cell. Each cell's
figure is printed as it is measured, the table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from strata_mgpu import env
from strata_mgpu.config import StageSwitches
from strata_mgpu.kernels.cpu_experts import GgmlExperts, ggml_missing
from strata_mgpu.kernels.run_queue import RunQueueDelta, RunQueueWait
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import PRESETS, write_model
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.host_cores import HostCoreExperts
from strata_mgpu.stage.stage import Stage, StageOptions

PROMPT = 32
MAX_STEPS = 4096  # a cell's KV room: decode stops there however fast
RECOVERY_LIMIT_S = 10.0


@dataclass
class Cell:
    busy: int  # spinner processes on the cores beside the stage
    threads: str  # a fixed count, or 'adaptive'
    tok_per_s: float
    steps: int
    seconds: float
    mean_threads: float  # the executor's count, averaged over the timed steps
    waiting: float  # the process's threads waiting for a core over the timed steps, on average (the policy's signal)
    slice_wait_us: float  # their run-queue wait a slice, likewise


@dataclass
class SharedHostReport:
    model: str
    cores: list[int]
    torch_threads: str
    cells: list[Cell] = field(default_factory=list)
    # spinners gone -> the adaptive executor back on every thread (None: not within RECOVERY_LIMIT_S, as where
    # other processes keep the cores busy)
    recovery_s: float | None = None


def parse_cores(text: str) -> list[int]:
    """'0-3', '0,2,4-5' -> sorted CPU ids; a ValueError naming the part that is not one."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not (lo.isascii() and lo.isdecimal() and (not dash or (hi.isascii() and hi.isdecimal()))) or (
                dash and int(hi) < int(lo)):
            raise ValueError(f"--cores {text!r}: {part!r} is not a CPU id or a range like 0-3")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cores)


def parse_counts(text: str, option: str, low: int) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} {text!r}: comma-separated whole numbers") from None
    if any(c < low for c in counts):
        raise ValueError(f"{option} {text!r}: each {low} or more")
    return counts


def default_busy(n: int) -> list[int]:
    return sorted({0, 1, n // 2, n})


def default_threads(n: int) -> list[int]:
    """Every count up to 8 cores; beyond, 1, 2 and each quarter of the cores."""
    return list(range(1, n + 1)) if n <= 8 else sorted({1, 2} | {n * i // 4 for i in range(1, 5)})


class Spinners:
    """`n` busy processes, each confined to `cores`; each ends by itself within a fraction of a
    second of this process's end, however it ends."""

    def __init__(self, n: int, cores: list[int]):
        code = (f"import os\nos.sched_setaffinity(0, {set(cores)!r})\nparent = {os.getpid()}\n"
                "while os.getppid() == parent:\n    for _ in range(1 << 20):\n        pass\n")
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def decode_for(stage: Stage, warmup_s: float, seconds: float, seed: int
               ) -> tuple[int, float, float, RunQueueDelta | None]:
    """(steps, seconds, mean threads, run-queue wait) of a timed stretch of batch-1 decode after an
    untimed one."""
    executor = stage.experts.executor if isinstance(stage.experts, HostCoreExperts) else None
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, stage.spec.vocab_size, (PROMPT + MAX_STEPS + 1,), generator=g)
    kv = stage.new_sequence(PROMPT + MAX_STEPS + 1)
    stage.prefill(kv, tokens[:PROMPT])
    pos = PROMPT
    t_end = time.perf_counter() + warmup_s
    while pos < PROMPT + 2 or (time.perf_counter() < t_end and pos < PROMPT + MAX_STEPS // 2):
        int(stage.decode([kv], tokens[pos:pos + 1])[0].argmax())
        pos += 1
    steps, used = 0, 0
    run_queue = RunQueueWait()
    t0 = time.perf_counter()
    while steps < 2 or (time.perf_counter() - t0 < seconds and pos < PROMPT + MAX_STEPS):
        int(stage.decode([kv], tokens[pos:pos + 1])[0].argmax())  # random tokens fed, as tools/bench does
        pos, steps = pos + 1, steps + 1
        used += executor.threads_now if isinstance(executor, GgmlExperts) else 0
    return steps, time.perf_counter() - t0, used / steps, run_queue.delta()


def recovery(stage: Stage, limit_s: float) -> float | None:
    """Seconds of decode until the adaptive executor is back on its every thread."""
    assert isinstance(stage.experts, HostCoreExperts) and isinstance(stage.experts.executor, GgmlExperts)
    executor = stage.experts.executor
    kv = stage.new_sequence(PROMPT + MAX_STEPS + 1)
    tokens = torch.randint(0, stage.spec.vocab_size, (PROMPT + MAX_STEPS + 1,))
    stage.prefill(kv, tokens[:PROMPT])
    t0, pos = time.perf_counter(), PROMPT
    while executor.threads_now < executor.threads:
        if time.perf_counter() - t0 > limit_s:
            return None
        if pos == PROMPT + MAX_STEPS:  # the KV room spent: a fresh sequence
            kv, pos = stage.new_sequence(PROMPT + MAX_STEPS + 1), PROMPT
            stage.prefill(kv, tokens[:PROMPT])
        stage.decode([kv], tokens[pos:pos + 1])
        pos += 1
    return time.perf_counter() - t0


def build(f: GGUFFile, environment: env.EnvOptions, threads: int, adaptive: bool, torch_cores: int | None) -> Stage:
    spec = spec_from_gguf(f)
    switches = StageSwitches.from_env(environment, adapt_threads=adaptive)
    opts = StageOptions(device=torch.device("cpu"), switches=switches, host_core_experts=True, threads=threads,
                        chunk_size=PROMPT, kv_tokens=PROMPT + MAX_STEPS + 1)
    stage = build_stage(f, spec, opts)
    if torch_cores is not None:
        torch.set_num_threads(torch_cores)
    return stage


def main(argv: list[str] | None = None) -> int:
    environment = env.read_or_exit()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="a GGUF file (default: the preset, written first)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--cores", default=None, help="CPU ids the stage and the spinners share, e.g. 0-3 (default: "
                                                  "this process's)")
    p.add_argument("--busy", default=None, help="spinner counts, comma-separated (default: 0, 1, half, all)")
    p.add_argument("--threads", default=None, help="fixed thread counts, comma-separated (default: 1 to the cores)")
    p.add_argument("--no-adaptive", action="store_true", help="no adaptive column")
    p.add_argument("--torch-threads", choices=("follow", "cores"), default="follow")
    p.add_argument("--warmup", type=float, default=1.0, help="untimed seconds of decode a cell")
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds of decode a cell")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if ggml_missing() is not None:
        raise SystemExit(f"error: {ggml_missing()}")
    try:
        cores = parse_cores(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
        allowed = os.sched_getaffinity(0)
        if not set(cores) <= allowed:
            raise ValueError(f"--cores {args.cores}: this process may only use {sorted(allowed)}")
        busy = parse_counts(args.busy, "--busy", 0) if args.busy else default_busy(len(cores))
        fixed = parse_counts(args.threads, "--threads", 1) if args.threads else default_threads(len(cores))
        if args.warmup < 0 or args.seconds <= 0:
            raise ValueError("--warmup 0 or more, --seconds more than 0")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    os.sched_setaffinity(0, cores)  # before the stage's threads start: they inherit it
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else Path(tmp) / f"{args.preset}.gguf"
        if not args.model:
            write_model(path, args.preset)
        report = sweep(GGUFFile(path), str(args.model or f"the {args.preset} preset"), environment, args, cores,
                       busy, fixed)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 0


def sweep(f: GGUFFile, model: str, environment: env.EnvOptions, args: argparse.Namespace, cores: list[int],
          busy: list[int], fixed: list[int]) -> SharedHostReport:
    report = SharedHostReport(model=model, cores=cores, torch_threads=args.torch_threads)
    columns: list[tuple[str, int, bool]] = [(str(k), k, False) for k in fixed]
    if not args.no_adaptive:
        columns.append(("adaptive", len(cores), True))
    est = len(columns) * len(busy) * (args.warmup + args.seconds)
    print(f"{model}: a CPU stage on cores {args.cores or cores}, batch-1 decode tok/s beside busy spinner "
          f"processes on the same cores (about {est:.0f} s; figures of a shared host vary run to run)", flush=True)
    table: dict[tuple[int, str], Cell] = {}
    for name, threads, adaptive in columns:
        torch_cores = len(cores) if args.torch_threads == "cores" and not adaptive else None
        stage = build(f, environment, threads, adaptive, torch_cores)
        executor = stage.experts.executor if isinstance(stage.experts, HostCoreExperts) else None
        if not isinstance(executor, GgmlExperts):
            raise SystemExit("error: the stage does not compute its experts with ggml")
        for b in busy:
            spinners = Spinners(b, cores)
            try:
                time.sleep(0.05)  # the spinners running
                steps, seconds, mean, waited = decode_for(stage, args.warmup, args.seconds, seed=b)
            finally:
                spinners.stop()
            wait_s, slices = (waited.wait_s, waited.slices) if waited is not None else (0.0, 0)
            table[b, name] = cell = Cell(b, name, steps / seconds, steps, seconds, mean, wait_s / seconds,
                                         1e6 * wait_s / max(1, slices))
            print(f"  threads {name}, {b} busy: {cell.tok_per_s:.1f} tok/s ({steps} steps"
                  + (f", {mean:.1f} threads on average" if adaptive else "")
                  + f"; {cell.waiting:.2f} threads waiting for a core, {cell.slice_wait_us:.0f} us a slice)",
                  flush=True)
        if adaptive:
            spinners = Spinners(max(busy), cores)
            try:
                decode_for(stage, args.warmup, 0.1, seed=0)  # settled under the heaviest load
            finally:
                spinners.stop()
            report.recovery_s = recovery(stage, RECOVERY_LIMIT_S)
        executor.close()
        del stage, executor
    print(f"{'busy':>5} " + " ".join(f"{name:>15}" for name, _, _ in columns))
    report.cells = [table[b, name] for b in busy for name, _, _ in columns]
    for b in busy:
        row = []
        for name, _, adaptive in columns:
            c = table[b, name]
            row.append(f"{c.tok_per_s:.1f}" + (f" (k~{c.mean_threads:.1f})" if adaptive else ""))
        print(f"{b:>5} " + " ".join(f"{x:>15}" for x in row))
    if not args.no_adaptive:
        print("adaptive: back on every thread " + (f"{report.recovery_s:.1f} s after the spinners stopped"
                                                    if report.recovery_s is not None
                                                    else f"not within {RECOVERY_LIMIT_S:.0f} s (other processes "
                                                    "keep the cores busy?)"))
    return report


if __name__ == "__main__":
    sys.exit(main())
