"""Time decode's kernels on one GPU without a model file: the fused expert kernels on one layer of
a preset's shapes (experts in VRAM slots, or a share of them read from pinned host memory; for
wider gathered passes, pick by pick against expert by expert, `kernels.moe_grouped`), decode
attention at several context lengths, the dense projections (q/k/v and the head: the bf16 GEMM
against `dense_q8` on Q8_0 blocks), and a whole layer's dequantization (what bounds a prompt
whose experts are all resident). Each fast path is checked once against its twin on the same
inputs. A run takes seconds: no 20 GB file to write and load, so a kernel change is measured in
one short device call.

    python3 -m strata_mgpu.tools.bench_kernels [--preset 30b-a3b] [--batch 1,8] [--iters 100]
        [--host-share 0] [--contexts 1024,8192,32768] [--expert-rows 8,16,...,512] [--json OUT]

The bound printed beside each figure is bytes over the card's device-to-device copy bandwidth,
measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.model.synthetic import DEFAULT_DOWN, PRESETS, TensorPlan, make_tensor
from strata_mgpu.stage.device import DeviceContext

BF16_TOL = 2e-2  # max|diff| / max|ref|: bf16 results whose sums run in another order
TWIN_ROWS = 8  # rows up to which the experts are checked against the twin (it loops on the host)


@dataclass
class KernelTiming:
    what: str
    batch: int
    us: float  # median a call
    bytes: int  # what the call must read (and write)
    bound_us: float  # bytes at the measured copy bandwidth
    rel_err: float | None = None  # against the twin, where checked


@dataclass
class KernelReport:
    device: str
    preset: str
    copy_gb_per_s: float
    timings: list[KernelTiming] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def expert_layer(preset: str, gate_type: Q = Q.Q4_K, seed: int = 0) -> tuple[ExpertLayout, np.ndarray]:
    """One layer's experts as the arena lays them out: [E, expert_bytes] uint8, each expert its gate
    rows, up rows, then down rows, in whole blocks."""
    spec = PRESETS[preset].spec(preset)
    down_type = DEFAULT_DOWN.get(gate_type, gate_type)
    e, d, f = spec.n_experts, spec.hidden, spec.expert_ffn
    plans = [TensorPlan(f"{k}", (e, f, d), gate_type, std=1 / math.sqrt(d)) for k in ("gate", "up")]
    plans.append(TensorPlan("down", (e, d, f), down_type, std=1 / math.sqrt(f)))
    gate, up, down = (make_tensor(p, seed).reshape(e, -1) for p in plans)
    lay = ExpertLayout(gate_type=gate_type, down_type=down_type, gate_bytes=gate.shape[1], down_bytes=down.shape[1],
                       gate_weights=f * d, down_weights=d * f)
    return lay, np.concatenate([gate, up, down], axis=1)


class SyntheticCache:
    """A `ResidentExperts` of one layer: experts whose `resident` flag is set in VRAM slots (slot e
    holds expert e), the rest in the host arena."""

    def __init__(self, arena: np.ndarray, resident: torch.Tensor, device: torch.device, pin: bool):
        from strata_mgpu.stage.host.pinned import host_buffer

        e, nbytes = arena.shape
        host = host_buffer(arena.size, pin=pin)
        host.numpy()[:] = arena.reshape(-1)
        self.host = host  # the arena, pinned
        self.slots = torch.from_numpy(arena.reshape(-1)).to(device)  # every expert has a slot; unused ones idle
        self.slot_bytes = nbytes
        self.slot_of = torch.where(resident, torch.arange(e), -1).view(1, e).to(device)
        self.host_offset = (torch.arange(e, dtype=torch.int64) * nbytes).view(1, e).to(device)
        self.per_layer = int(resident.sum())  # experts resident in VRAM slots

    def addresses(self, i: int, picks: torch.Tensor) -> torch.Tensor:
        slot = self.slot_of[i, picks]
        host = self.host.data_ptr() + self.host_offset[i, picks]
        return torch.where(slot >= 0, self.slots.data_ptr() + slot * self.slot_bytes, host)

    def source(self, i: int, e: int) -> torch.Tensor:
        at = int(self.host_offset[i, e])
        if int(self.slot_of[i, e]) >= 0:
            return self.slots[at:at + self.slot_bytes]
        return self.host[at:at + self.slot_bytes]


def random_routing(batch: int, n_experts: int, n_used: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, A] fp32 summing to 1, experts [B, A], distinct within a row)."""
    experts = torch.stack([torch.randperm(n_experts, generator=g)[:n_used] for _ in range(batch)])
    weights = torch.softmax(torch.randn(batch, n_used, generator=g), dim=-1)
    return weights, experts


def q8_0_rows(n: int, k: int, device: torch.device) -> torch.Tensor:
    """n rows of k weights in valid Q8_0 blocks, made on the device: random int8, each block's scale
    1 / (127 sqrt(k)) (unit-variance outputs)."""
    blocks = torch.randint(-127, 128, (n, k // 32, 34), dtype=torch.int8, device=device).view(torch.uint8)
    scale = torch.tensor([1 / (127 * math.sqrt(k))], dtype=torch.float16).view(torch.uint8)  # 2 bytes
    blocks[:, :, :2] = scale.to(device)
    return blocks.reshape(n, -1)


def _dequant_q8_0(raw: torch.Tensor, k: int) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], k // 32, 34)
    scale = blocks[:, :, :2].contiguous().view(torch.float16).float()  # [N, K / 32, 1]
    q = blocks[:, :, 2:].contiguous().view(torch.int8).float()  # [N, K / 32, 32]
    return (q * scale).reshape(raw.shape[0], k).bfloat16()


def time_us(ctx: DeviceContext, fn, iters: int) -> float:
    """Microseconds a call of `fn`'s launches takes on the device: captured once as a CUDA graph and
    replayed `iters` times, so the host's launch cost is not counted. The median of three runs."""
    side = ctx.new_stream("capture")
    ctx.wait_stream(ctx.current_stream(), on=side)
    with ctx.use(side):  # warm-up outside the capture
        fn()
    ctx.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with ctx.capture(graph, None, side, mode="global"):  # torch.cuda.graph's defaults, as before
        fn()
    runs = []
    for _ in range(3):
        start = ctx.mark()
        for _ in range(iters):
            graph.replay()
        runs.append(1e6 * ctx.mark().seconds_since(start) / iters)
    return statistics.median(runs)


def copy_bandwidth(ctx: DeviceContext, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    us = time_us(ctx, lambda: dst.copy_(src), 10)
    return 2 * nbytes / us / 1e3


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@contextlib.contextmanager
def grouped_from(picks: int):
    """Gathered passes go expert by expert from `picks` picks on, for the block's duration."""
    from strata_mgpu.kernels import experts

    was, experts.GROUPED_MIN_PICKS = experts.GROUPED_MIN_PICKS, picks
    try:
        yield
    finally:
        experts.GROUPED_MIN_PICKS = was


@contextlib.contextmanager
def down_rows_at_most(rows: int):
    """moe_down's blocks take at most `rows` rows of D, for the block's duration."""
    from strata_mgpu.kernels import experts

    was, experts.MOE_DOWN_ROWS = experts.MOE_DOWN_ROWS, rows
    try:
        yield
    finally:
        experts.MOE_DOWN_ROWS = was


def routing_err(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], n_experts: int
                ) -> float:
    """Two routings as [T, E] weights, compared: a different pick is an error as large as its weight,
    whatever the order of the picks."""
    def by_expert(weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return torch.zeros(weights.shape[0], n_experts, device=weights.device).scatter_(1, experts, weights.float())
    return rel_err(by_expert(*got), by_expert(*want))


def run(preset: str, batches: list[int], contexts: list[int], iters: int, host_share: float,
        device: torch.device, expert_rows: tuple[int, ...] = (), down_rows: tuple[int, ...] = ()) -> KernelReport:
    from strata_mgpu.kernels.decode_ops import CudaDecodeOps
    from strata_mgpu.kernels.experts import CardCapabilities, CudaKernels, TorchKernels
    from strata_mgpu.model.kv_cache import KVCache
    from strata_mgpu.model.ops import DecodeOps

    spec = PRESETS[preset].spec(preset)
    g = torch.Generator().manual_seed(0)
    lay, arena = expert_layer(preset)
    e, a, d, f = spec.n_experts, spec.n_experts_used, spec.hidden, spec.expert_ffn
    resident = torch.rand(e, generator=g) >= host_share
    cache = SyntheticCache(arena, resident, device, pin=True)
    caps = CardCapabilities.probe(device)  # the grouped GEMM forced on: the twin's path it times
    kernels = CudaKernels(device, replace(caps, grouped_mm=True,
                                          grouped_mm_sync_free=torch.cuda.get_device_capability(device) >= (9, 0)))
    kernels.compile()
    ctx = DeviceContext(device)  # its streams and timing marks
    report = KernelReport(device=torch.cuda.get_device_name(device), preset=preset,
                          copy_gb_per_s=copy_bandwidth(ctx))
    def bound(nbytes: int) -> float:  # microseconds to move nbytes at the copy's rate (its reads and writes)
        return nbytes / report.copy_gb_per_s / 1e3

    where = f"{100 * (1 - host_share):.0f}% in VRAM"
    for b in sorted(set(batches) | set(expert_rows)):
        weights, experts = random_routing(b, e, a, g)
        weights, experts = weights.to(device), experts.to(device)
        h = torch.randn(b, d, generator=g).to(device, torch.bfloat16)
        # the workspace only the twin uses (the kernels read the blocks): for the rows it checks
        w_gu = torch.empty(b * a if b <= TWIN_ROWS else 0, 2 * f, d, dtype=torch.bfloat16, device=device)
        w_d = torch.empty(b * a if b <= TWIN_ROWS else 0, d, f, dtype=torch.bfloat16, device=device)
        nbytes = int(torch.unique(experts).numel()) * lay.expert_bytes
        with grouped_from(10**9):  # decode's kernels, pick by pick
            by_pick = kernels.moe_gathered(cache, 0, lay, h, weights, experts, w_gu, w_d)
            us = time_us(ctx, partial(kernels.moe_gathered, cache, 0, lay, h, weights, experts, w_gu, w_d), iters)
        err = None
        if b <= TWIN_ROWS:  # the twin goes pick by pick on the host: only for a few rows
            err = rel_err(by_pick, TorchKernels().moe_fused_reference(cache, 0, lay, h, weights, experts, w_gu, w_d))
        if b in batches:
            report.timings.append(KernelTiming(f"fused experts ({where})", b, us, nbytes, bound(nbytes), err))
            for rows in down_rows:  # the same pass with moe_down's blocks taking fewer rows of D
                with down_rows_at_most(rows), grouped_from(10**9):
                    plan = kernels.moe_fused(lay, d, a)
                    assert plan is not None
                    us_rows = time_us(ctx, partial(kernels.moe_gathered, cache, 0, lay, h, weights, experts, w_gu,
                                                   w_d), iters)
                report.timings.append(KernelTiming(f"fused experts, moe_down {plan.rows_down} rows a block", b,
                                                   us_rows, nbytes, bound(nbytes)))
        if b in expert_rows:
            report.timings.append(KernelTiming(f"experts pick by pick ({where})", b, us, nbytes, bound(nbytes), err))
            with grouped_from(0):  # expert by expert, held to the pick-by-pick kernels (bit for bit)
                before = kernels.paths["moe_gathered:grouped"]
                grouped = kernels.moe_gathered(cache, 0, lay, h, weights, experts, w_gu, w_d)
                if kernels.paths["moe_gathered:grouped"] > before:
                    us = time_us(ctx, partial(kernels.moe_gathered, cache, 0, lay, h, weights, experts, w_gu, w_d),
                                 iters)
                    # held to the pick-by-pick kernels bit for bit: any difference fails the run
                    exact = 0.0 if torch.equal(grouped, by_pick) else float("inf")
                    report.timings.append(KernelTiming(f"experts by expert ({where})", b, us, nbytes, bound(nbytes),
                                                       exact))
    ops, twin = CudaDecodeOps(device), DecodeOps()
    router = torch.randn(e, d, generator=g).to(device) / 16
    norm_w = (torch.rand(d, generator=g) + 0.5).to(device, torch.bfloat16)
    for b in batches:  # the MoE block's input: residual add, norm, routing, h quantized (one launch)
        x, y = (torch.randn(b, d, generator=g).to(device, torch.bfloat16) for _ in range(2))
        got, want = (o.moe_input(x, y, norm_w, 1e-6, router, a, True) for o in (ops, twin))
        us = time_us(ctx, partial(ops.moe_input, x, y, norm_w, 1e-6, router, a, True), iters)
        nbytes = router.numel() * 4 + 4 * x.numel() * 2
        report.timings.append(KernelTiming("MoE input (add, norm, route, quantize)", b, us, nbytes, bound(nbytes),
                                           max(rel_err(got[1], want[1]), routing_err(got[2:4], want[2:4], e))))
    for n in contexts:
        for b in batches:
            kvs = []
            for _ in range(b):
                kv = KVCache(1, spec.n_kv_heads, spec.head_dim, capacity=n, max_length=n, device=device,
                             dtype=torch.bfloat16)
                kv.k.normal_()
                kv.v.normal_()
                kvs.append(kv)
            positions = torch.full((b,), n - 1, dtype=torch.long, device=device)
            q = torch.randn(b, spec.n_heads, spec.head_dim, device=device, dtype=torch.bfloat16)
            err = rel_err(ops.attention(0, q, positions, kvs), twin.attention(0, q, positions, kvs))
            us = time_us(ctx, partial(ops.attention, 0, q, positions, kvs), iters)
            nbytes = b * 2 * n * spec.kv_dim * 2
            report.timings.append(KernelTiming(f"attention at {n:,} keys", b, us, nbytes, bound(nbytes), err))
    from strata_mgpu.kernels.dense import dense_q8, dense_reference

    # decode's dense projections: the bf16 GEMM against dense_q8 on the file's Q8_0
    kv_rows = (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim
    for what, n_rows, check in (("q/k/v projection", kv_rows, True), ("output head", spec.vocab_size, False)):
        raw = q8_0_rows(n_rows, d, device)
        w_bf16 = _dequant_q8_0(raw, d)  # [N, K] bf16: the weights as a bf16 stage holds them
        for b in batches:
            h = torch.randn(b, d, generator=g).to(device, torch.bfloat16)
            us = time_us(ctx, partial(torch.matmul, h, w_bf16.T), iters)
            nbytes = 2 * n_rows * d
            report.timings.append(KernelTiming(f"{what}, bf16 weights (torch GEMM)", b, us, nbytes, bound(nbytes)))
            err = rel_err(dense_q8(kernels, h, raw, Q.Q8_0), dense_reference(h, raw, Q.Q8_0)) if check else None
            us = time_us(ctx, partial(dense_q8, kernels, h, raw, Q.Q8_0), iters)
            nbytes = raw.numel()
            report.timings.append(KernelTiming(f"{what}, from Q8_0 blocks (dense_q8)", b, us, nbytes, bound(nbytes),
                                               err))
        del raw, w_bf16
    addresses = cache.addresses(0, torch.arange(e, device=device))
    w_gu = torch.empty(e, 2 * f, d, dtype=torch.bfloat16, device=device)
    w_d = torch.empty(e, d, f, dtype=torch.bfloat16, device=device)
    us = time_us(ctx, partial(kernels._dequant_by_address, addresses, lay, e, w_gu, w_d), max(5, iters // 10))
    nbytes = e * lay.expert_bytes + 2 * (w_gu.numel() + w_d.numel())
    report.timings.append(KernelTiming("dequantize a whole layer to bf16", e, us, nbytes, bound(nbytes)))
    return report


def print_report(r: KernelReport) -> None:
    print(f"{r.device}, {r.preset} shapes; device copy {r.copy_gb_per_s:,.0f} GB/s")
    print(f"{'kernel':<44} {'rows':>5} {'us':>9} {'MB':>8} {'bound us':>9} {'of bound':>9} {'rel err':>9}")
    for t in r.timings:
        err = "" if t.rel_err is None else f"{t.rel_err:.1e}"
        print(f"{t.what:<44} {t.batch:>5} {t.us:>9.1f} {t.bytes / 1e6:>8.1f} {t.bound_us:>9.1f} "
              f"{t.bound_us / t.us:>9.2f} {err:>9}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--batch", default="1,8", help="decode rows, comma-separated")
    ap.add_argument("--contexts", default="1024,8192,32768", help="attention key counts, comma-separated")
    ap.add_argument("--expert-rows", default="8,16,32,64,128,256,512",
                    help="rows of a gathered pass whose experts are timed pick by pick and expert by expert")
    ap.add_argument("--down-rows", default="", help="moe_down's rows a block to time the fused experts at too, "
                    "comma-separated (default: the plan's only)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--host-share", type=float, default=0.0, help="share of experts read from pinned host memory")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA device")
    if not 0 <= args.host_share <= 1:
        sys.exit(f"--host-share {args.host_share}: expected 0 to 1")
    try:
        batches = [int(x) for x in args.batch.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
        expert_rows = tuple(int(x) for x in args.expert_rows.split(",") if x)
        down_rows = tuple(int(x) for x in args.down_rows.split(",") if x)
    except ValueError:
        sys.exit("--batch, --contexts, --expert-rows and --down-rows take comma-separated whole numbers")
    if any(r < 1 for r in down_rows):
        sys.exit("--down-rows: 1 or more")
    report = run(args.preset, batches, contexts, args.iters, args.host_share, torch.device("cuda", 0), expert_rows,
                 down_rows)
    print_report(report)
    bad = [t for t in report.timings if t.rel_err is not None and not t.rel_err <= BF16_TOL]
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(report.to_json())
    if bad:
        sys.exit(f"{len(bad)} kernel(s) differ from their twin by more than {BF16_TOL}: "
                 + ", ".join(f"{t.what} x{t.batch} ({t.rel_err:.2e})" for t in bad))


if __name__ == "__main__":
    main()
