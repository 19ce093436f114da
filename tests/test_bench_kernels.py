"""tools/bench_kernels: the synthetic layer and cache it times the kernels on, without a GPU; and a
short run of the tool itself on the lent GPU (marker `gpu`; skipped without CUDA)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.model.reference import moe_reference
from strata_mgpu.model.synthetic import PRESETS
from strata_mgpu.quant.dequant import dequantize
from strata_mgpu.quant.formats import block_format
from strata_mgpu.tools.bench_kernels import BF16_TOL, SyntheticCache, expert_layer, random_routing

FP32_TOL = 1e-5  # max|diff| / max|ref|, both fp32 (as tests/test_quant_stage.py): summation order only


def test_the_synthetic_layer_is_laid_out_as_the_arena_lays_experts():
    spec = PRESETS["tiny"].spec("tiny")
    lay, arena = expert_layer("tiny")
    d, f = spec.hidden, spec.expert_ffn
    assert (lay.gate_type, lay.down_type) == (Q.Q4_K, Q.Q6_K)
    assert lay.gate_bytes == f * block_format(Q.Q4_K).row_bytes(d)
    assert lay.down_bytes == d * block_format(Q.Q6_K).row_bytes(f)
    assert arena.shape == (spec.n_experts, lay.expert_bytes) and arena.dtype.name == "uint8"


def test_the_synthetic_cache_serves_each_expert_from_its_tier():
    spec = PRESETS["tiny"].spec("tiny")
    lay, arena = expert_layer("tiny")
    resident = torch.arange(spec.n_experts) % 2 == 0
    cache = SyntheticCache(arena, resident, torch.device("cpu"), pin=False)
    picks = torch.arange(spec.n_experts)
    addresses = cache.addresses(0, picks).tolist()
    for e in range(spec.n_experts):
        src = cache.source(0, e)
        assert src.data_ptr() == addresses[e] and bytes(src.numpy()) == arena[e].tobytes()
        assert (src.data_ptr() >= cache.slots.data_ptr() and src.data_ptr() < cache.slots.data_ptr()
                + cache.slots.numel()) == bool(resident[e])
    g = torch.Generator().manual_seed(1)
    weights, experts = random_routing(5, spec.n_experts, spec.n_experts_used, g)
    assert all(len(set(row)) == spec.n_experts_used for row in experts.tolist())
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    h = torch.randn(5, spec.hidden, generator=g)
    m = 5 * spec.n_experts_used
    w_gu = torch.empty(m, 2 * spec.expert_ffn, spec.hidden)
    w_d = torch.empty(m, spec.hidden, spec.expert_ffn)
    out = TorchKernels().moe_gathered(cache, 0, lay, h, weights, experts, w_gu, w_d)  # the twin the tool checks with
    assert out.shape == (5, spec.hidden) and torch.isfinite(out).all() and out.abs().max() > 0
    # the oracle on the same picks: every expert's blocks dequantized straight from the arena's
    # bytes (not through the cache), the SiLU-gated MLP one expert at a time, in fp32
    d, f, gb = spec.hidden, spec.expert_ffn, lay.gate_bytes
    dense = SimpleNamespace(gate=dequantize(arena[:, :gb], lay.gate_type, (spec.n_experts, f, d)),  # [E, F, D]
                            up=dequantize(arena[:, gb:2 * gb], lay.gate_type, (spec.n_experts, f, d)),
                            down=dequantize(arena[:, lay.down_offset:], lay.down_type, (spec.n_experts, d, f)))
    want = moe_reference(h, dense, weights, experts)  # [5, D]
    assert float((out - want).abs().max() / want.abs().max()) <= FP32_TOL


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the tool runs (test below)")
def test_without_a_gpu_it_says_so_in_one_line():
    r = subprocess.run([sys.executable, "-m", "strata_mgpu.tools.bench_kernels", "--preset", "tiny"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == "bench_kernels needs a CUDA device"


@pytest.mark.gpu
def test_a_short_run_on_the_gpu_reports_every_kernel_within_its_twins_tolerance(tmp_path):
    """`--preset tiny` with one and three decode rows, one context, one gathered pass of 16 rows and
    few iterations: the tool exits 0 (it exits 1 where a checked kernel differs from its twin by
    more than BF16_TOL), prints a line for each figure and writes them to --json. Every figure is
    there: the fused experts at each decode batch, the 16-row pass pick by pick and expert by
    expert (every expert resident: the grouped kernels take it, bit for bit), the MoE input (its
    norm and routing against the twin's), attention, both
    dense projections each way, a layer's dequant; times, bytes and bounds positive and finite;
    each error checked against the twin is finite and within BF16_TOL, the grouped one 0."""
    out = tmp_path / "kbench.json"
    r = subprocess.run([sys.executable, "-m", "strata_mgpu.tools.bench_kernels", "--preset", "tiny", "--batch", "1,3",
                        "--contexts", "256", "--expert-rows", "16", "--iters", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    spec = PRESETS["tiny"].spec("tiny")
    assert report["preset"] == "tiny" and math.isfinite(report["copy_gb_per_s"]) and report["copy_gb_per_s"] > 0
    where = "(100% in VRAM)"
    # (what, rows) -> how its error is checked: "twin" within BF16_TOL, "exact" 0, None not checked
    want = {(f"fused experts {where}", 1): "twin", (f"fused experts {where}", 3): "twin",
            (f"experts pick by pick {where}", 16): None, (f"experts by expert {where}", 16): "exact",
            ("attention at 256 keys", 1): "twin", ("attention at 256 keys", 3): "twin",
            ("dequantize a whole layer to bf16", spec.n_experts): None,
            **{("MoE input (add, norm, route, quantize)", b): "twin" for b in (1, 3)}}
    for what, check in (("q/k/v projection", "twin"), ("output head", None)):
        for b in (1, 3):
            want[(f"{what}, bf16 weights (torch GEMM)", b)] = None
            want[(f"{what}, from Q8_0 blocks (dense_q8)", b)] = check
    timings = {(t["what"], t["batch"]): t for t in report["timings"]}
    assert len(timings) == len(report["timings"]) and set(timings) == set(want)
    for key, check in want.items():
        t = timings[key]
        assert all(math.isfinite(t[k]) and t[k] > 0 for k in ("us", "bytes", "bound_us")), t
        if check is None:
            assert t["rel_err"] is None, t
        elif check == "exact":
            assert t["rel_err"] == 0.0, t
        else:
            assert math.isfinite(t["rel_err"]) and t["rel_err"] <= BF16_TOL, t
    lines = r.stdout.splitlines()
    assert lines[0].endswith(f"tiny shapes; device copy {report['copy_gb_per_s']:,.0f} GB/s")
    assert len(lines) == 2 + len(want) and all(line.startswith(t["what"]) for line, t in
                                               zip(lines[2:], report["timings"], strict=True))


def test_the_dense_rows_it_times_are_valid_q8_0_and_read_as_the_twin_reads_them():
    from strata_mgpu.quant.dequant import dequantize_rows
    from strata_mgpu.tools.bench_kernels import _dequant_q8_0, q8_0_rows

    raw = q8_0_rows(16, 512, torch.device("cpu"))
    assert raw.shape == (16, block_format(Q.Q8_0).row_bytes(512)) and raw.dtype == torch.uint8
    want = dequantize_rows(raw, Q.Q8_0, 512)
    assert torch.isfinite(want).all() and 0.3 < float(want.std()) * 512 ** 0.5 < 1.0  # unit-ish outputs
    assert torch.equal(_dequant_q8_0(raw, 512), want.bfloat16())
