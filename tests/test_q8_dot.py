"""The integer path of decode's fused expert kernels without a GPU: cuda_src/q8_dot.cuh's sub-block
dots compiled for the host with g++ (as tests/test_blocks_host.py does the block decoders) and
checked against fp64 sums of the twin's fp32 weights times the quantized activations; the twin's
quantizer (`q8_values`); and the twin of the whole fused pair on a synthetic layer.

The kernels themselves (quantize_q8, moe_gate_up, moe_down) run against this twin on the GPU, in
tests/test_gpu_quant.py.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.experts import Q8_DOT_TYPES, Q8_WORDS, TorchKernels, q8_values
from strata_mgpu.model.synthetic import PRESETS
from strata_mgpu.quant.dequant import dequantize_rows
from strata_mgpu.quant.formats import block_format
from strata_mgpu.tools.bench_kernels import SyntheticCache, expert_layer, random_routing
from tests.test_blocks_host import SHIM, build_host_lib
from tests.test_quant import fresh_seed, raw_blocks

DP4A_SHIM = r"""
inline int __dp4a(int a, int b, int c) {  // four signed byte products added to c
    for (int k = 0; k < 4; ++k) c += (int)(signed char)(a >> (8 * k)) * (int)(signed char)(b >> (8 * k));
    return c;
}
"""

HARNESS = r"""
#include "q8_dot.cuh"
template <int T> static void run(const u8* src, const unsigned* xq, long long n_sub, float* out) {
    const int per = Fmt<T>::QK / 32;
    for (long long i = 0; i < n_sub; ++i)
        out[i] = q8_dot<T>(src + (i / per) * Fmt<T>::BYTES, (int)(i % per), xq + Q8_WORDS * i);
}
#define CASE(T) case T: run<T>(src, xq, n_sub, out); return 0;
extern "C" int dots(int type, const u8* src, const unsigned* xq, long long n_sub, float* out) {
    switch (type) { Q8_DOT_TYPES(CASE) }
    return 1;
}
"""


@pytest.fixture(scope="module")
def host_dots(tmp_path_factory):
    so = build_host_lib(tmp_path_factory.mktemp("q8"), HARNESS, SHIM + DP4A_SHIM)
    so.dots.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
    return so


def quantize_words(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [n] (n a multiple of 32) -> (quantize_q8's words [n / 32, Q8_WORDS] uint32, the integers
    [n / 32, 32], the scales [n / 32]), computed as the twin does."""
    runs = x.float().reshape(-1, 32)
    dx = runs.abs().amax(1, keepdim=True) / 127
    q = torch.where(dx > 0, torch.round(runs / torch.where(dx > 0, dx, 1.0)), 0.0).to(torch.int32)
    words = np.zeros((runs.shape[0], Q8_WORDS), dtype=np.uint32)
    words[:, :8] = q.to(torch.int8).numpy().view(np.uint32)
    words[:, 8] = dx.numpy().reshape(-1).view(np.uint32)
    words[:, 9] = q[:, :16].sum(1).numpy().astype(np.int32).view(np.uint32)
    words[:, 10] = q[:, 16:].sum(1).numpy().astype(np.int32).view(np.uint32)
    return words, q.numpy(), dx.numpy().reshape(-1)


def test_the_header_lists_the_integer_types():
    src = nvrtc.cuda_source("q8_dot.cuh")
    listed = re.search(r"#define Q8_DOT_TYPES\(X\)(.*)", src).group(1)
    assert {int(t) for t in re.findall(r"X\((\d+)\)", listed)} == {int(t) for t in Q8_DOT_TYPES}
    assert f"constexpr int Q8_WORDS = {Q8_WORDS};" in src


@pytest.mark.parametrize("offset", [0, 1, 2, 3])  # blocks at any byte, as in a staged tile
@pytest.mark.parametrize("ggml_type", sorted(Q8_DOT_TYPES), ids=lambda t: t.name)
def test_integer_dots_on_the_host_equal_fp64_sums(host_dots, ggml_type, offset):
    fmt = block_format(ggml_type)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n = 256 * 12
    blocks = raw_blocks(ggml_type, n // fmt.block_size, rng)
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).bfloat16()
    x[:32] = 0  # an all-zero run: scale 0, integers 0
    words, q, dx = quantize_words(x)
    room = np.zeros(blocks.nbytes + 8, dtype=np.uint8)
    room[offset:offset + blocks.nbytes] = blocks.view(np.uint8).reshape(-1)
    got = np.full(n // 32, np.nan, dtype=np.float32)
    assert host_dots.dots(int(ggml_type), room.ctypes.data + offset, words.ctypes.data, n // 32, got.ctypes.data) == 0
    w = dequantize_rows(torch.from_numpy(blocks.reshape(1, -1)), ggml_type, n).numpy().reshape(-1, 32)
    terms = w.astype(np.float64) * (q * dx[:, None].astype(np.float64))
    want = terms.sum(1)
    scale = np.abs(terms).sum(1) + 1e-30
    assert np.all(np.abs(got - want) <= 1e-5 * scale), f"{fmt.name}, seed {seed}"
    assert got[0] == 0


def test_q8_values_round_each_run_to_its_own_scale():
    g = torch.Generator().manual_seed(fresh_seed())
    x = (torch.randn(3, 96, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(32)).bfloat16()
    x[2, 64:] = 0
    got = q8_values(x)
    runs, vals = x.float().reshape(-1, 32), got.reshape(-1, 32)
    dx = runs.abs().amax(1, keepdim=True) / 127
    assert torch.all((vals - runs).abs() <= dx / 2 + runs.abs() * 1e-6)  # half a step (and the product's rounding)
    assert torch.all(vals.abs().amax(1, keepdim=True) <= 127 * dx * (1 + 1e-6))
    assert torch.equal(got[2, 64:], torch.zeros(32))
    ints = vals / torch.where(dx > 0, dx, 1.0)
    assert torch.allclose(ints, ints.round(), atol=1e-4)  # integer multiples of the scale


def test_the_q8_twin_stays_near_the_grouped_twin():
    """The twin of the integer kernels (bf16 input: quantized activations, fp32 weights) against the
    grouped twin on the same picks (fp32 input: no quantization): close, as 8-bit activations are,
    and not equal, so the integer path really ran."""
    spec = PRESETS["tiny"].spec("tiny")
    lay, arena = expert_layer("tiny")
    cache = SyntheticCache(arena, torch.arange(spec.n_experts) % 2 == 0, torch.device("cpu"), pin=False)
    g = torch.Generator().manual_seed(fresh_seed())
    weights, experts = random_routing(4, spec.n_experts, spec.n_experts_used, g)
    h = torch.randn(4, spec.hidden, generator=g).bfloat16()
    m = 4 * spec.n_experts_used
    w_gu = torch.empty(m, 2 * spec.expert_ffn, spec.hidden)
    w_d = torch.empty(m, spec.hidden, spec.expert_ffn)
    q8 = TorchKernels().moe_fused_reference(cache, 0, lay, h, weights, experts, w_gu, w_d)
    ref = TorchKernels().moe_gathered(cache, 0, lay, h.float(), weights, experts, w_gu, w_d)
    assert q8.dtype == torch.bfloat16 and q8.shape == ref.shape
    err = float((q8.float() - ref).abs().max() / ref.abs().max())
    assert 0 < err < 3e-2, err
    # where the kernels do not run, bf16 input takes the grouped twin (no 8-bit rounding), not the reference
    fallback = TorchKernels().moe_gathered(cache, 0, lay, h, weights, experts, w_gu.bfloat16(), w_d.bfloat16())
    assert not torch.equal(fallback, q8)
    assert float((fallback.float() - ref).abs().max() / ref.abs().max()) < 2e-2
