"""tools/bench_kernels without a GPU: the synthetic layer and cache it times the kernels on (the
CUDA timing itself runs on the lent GPU)."""

from __future__ import annotations

import subprocess
import sys

import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.model.synthetic import PRESETS
from strata_mgpu.quant.formats import block_format
from strata_mgpu.tools.bench_kernels import SyntheticCache, expert_layer, random_routing


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
        assert (src.data_ptr() >= cache.buffer.data_ptr() and src.data_ptr() < cache.buffer.data_ptr()
                + cache.buffer.numel()) == bool(resident[e])
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


def test_without_a_gpu_it_says_so_in_one_line():
    r = subprocess.run([sys.executable, "-m", "strata_mgpu.tools.bench_kernels", "--preset", "tiny"],
                       capture_output=True, text=True, timeout=120)
    if torch.cuda.is_available():
        return  # the GPU session runs it for real
    assert r.returncode == 1 and r.stderr.strip() == "bench_kernels needs a CUDA device"


def test_the_dense_rows_it_times_are_valid_q8_0_and_read_as_the_twin_reads_them():
    from strata_mgpu.quant.dequant import dequantize_rows
    from strata_mgpu.tools.bench_kernels import _dequant_q8_0, q8_0_rows

    raw = q8_0_rows(16, 512, torch.device("cpu"))
    assert raw.shape == (16, block_format(Q.Q8_0).row_bytes(512)) and raw.dtype == torch.uint8
    want = dequantize_rows(raw, Q.Q8_0, 512)
    assert torch.isfinite(want).all() and 0.3 < float(want.std()) * 512 ** 0.5 < 1.0  # unit-ish outputs
    assert torch.equal(_dequant_q8_0(raw, 512), want.bfloat16())
