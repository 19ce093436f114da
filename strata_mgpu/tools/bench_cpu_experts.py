"""Time the CPU expert executor (`kernels.cpu_experts`) on one layer of a preset's shapes, no model
file: the layer's picks at each batch size, fresh experts every repetition, and the GB/s of
expert bytes that gives (each call's distinct picked experts' bytes over its wall time).

    python3 -m strata_mgpu.tools.bench_cpu_experts [--preset 30b-a3b] [--gate-type Q4_K]
        [--threads N] [--batch 1,8] [--picks K] [--poll P] [--reps 64] [--json OUT]

`--picks K`: K picks a row rather than the preset's A (a GPU stage's hand-over sends the host one
or two a layer); `--poll P`: ggml's polling level for the pool's idle workers (0: they sleep).
Each repetition picks experts in a block that moves through the layer, so its experts are not the
ones the last left in the caches. The executor is checked once against its twin.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.kernels.cpu_experts import (
    GgmlExperts,
    TorchExperts,
    clamp_threads,
    default_threads,
    ggml_missing,
    select_cpu_experts,
)
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.model.synthetic import PRESETS
from strata_mgpu.tools.bench_kernels import expert_layer


@dataclass
class CpuExpertTiming:
    batch: int
    ms: float  # median a call (one layer's picks of `batch` rows)
    expert_bytes: int  # distinct experts a call reads, in bytes (the median call's)
    gb_per_s: float


@dataclass
class CpuExpertReport:
    preset: str
    gate_type: str
    down_type: str
    executor: str
    threads: int
    expert_bytes: int  # one expert's
    rel_err: float  # against the twin at batch 1 (max|diff| / max|twin|)
    timings: list[CpuExpertTiming] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def fresh_picks(rep: int, batch: int, n_used: int, n_experts: int) -> torch.Tensor:
    """[batch, A] picks of repetition `rep`: distinct in a row, a block of experts moving through the
    layer rep by rep."""
    first = rep * batch * n_used
    flat = (first + torch.arange(batch * n_used)) % n_experts
    return flat.view(batch, n_used)


def time_batches(executor, layer: torch.Tensor, lay: ExpertLayout, hidden: int, n_used: int, batches: list[int],
                 reps: int) -> list[CpuExpertTiming]:
    n_experts = layer.numel() // lay.expert_bytes
    gen = torch.Generator().manual_seed(0)
    out = []
    for b in batches:
        h = torch.randn(b, hidden, generator=gen)
        weights = torch.rand(b, n_used, generator=gen)
        for r in range(2):  # warm-up: the graph built, the pool's threads started
            executor.moe(layer, lay, h, weights, fresh_picks(reps + r, b, n_used, n_experts))
        times, nbytes = [], []
        for r in range(reps):
            picks = fresh_picks(r, b, n_used, n_experts)
            t0 = time.perf_counter()
            executor.moe(layer, lay, h, weights, picks)
            times.append(time.perf_counter() - t0)
            nbytes.append(int(picks.unique().numel()) * lay.expert_bytes)
        med = statistics.median(times)
        out.append(CpuExpertTiming(batch=b, ms=1e3 * med, expert_bytes=int(statistics.median(nbytes)),
                                   gb_per_s=statistics.median(nbytes) / med / 1e9))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--gate-type", default="Q4_K", help="experts' gate/up type (down: what files pair with it)")
    p.add_argument("--threads", type=int, default=None, help="default: every physical core")
    p.add_argument("--batch", default="1", help="rows a call, comma-separated")
    p.add_argument("--picks", type=int, default=None, help="picks a row (default: the preset's experts per token)")
    p.add_argument("--poll", type=int, default=0, help="ggml's polling level of idle workers, 0-100")
    p.add_argument("--reps", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    spec = PRESETS[args.preset].spec(args.preset)
    gate_type = Q[args.gate_type.upper()]
    threads = args.threads or default_threads(0)
    threads, warning = clamp_threads(threads)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    lay, blocks = expert_layer(args.preset, gate_type)
    layer = torch.from_numpy(blocks.reshape(-1))
    polled = args.poll and ggml_missing() is None
    executor = GgmlExperts(threads, poll=args.poll) if polled else select_cpu_experts(threads)
    n_used = args.picks or spec.n_experts_used
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(1, spec.hidden, generator=gen), torch.rand(1, n_used, generator=gen)
    picks = fresh_picks(0, 1, n_used, spec.n_experts)
    got, want = executor.moe(layer, lay, h, w, picks), TorchExperts().moe(layer, lay, h, w, picks)
    rel = float((got - want).abs().max() / want.abs().max())
    report = CpuExpertReport(preset=args.preset, gate_type=lay.gate_type.name, down_type=lay.down_type.name,
                             executor=executor.describe(), threads=executor.threads, expert_bytes=lay.expert_bytes,
                             rel_err=rel)
    report.timings = time_batches(executor, layer, lay, spec.hidden, n_used,
                                  [int(b) for b in args.batch.split(",")], args.reps)
    print(f"{args.preset} experts {lay.gate_type.name}/{lay.down_type.name}, {lay.expert_bytes / 1e6:.2f} MB each, "
          f"{n_used} picks a row; "
          f"{report.executor}; against the twin {rel:.2e}")
    for t in report.timings:
        print(f"  batch {t.batch:4d}: {t.ms:8.3f} ms a layer, {t.expert_bytes / 1e6:8.1f} MB of experts, "
              f"{t.gb_per_s:6.1f} GB/s")
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(report.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
