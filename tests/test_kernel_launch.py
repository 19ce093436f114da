"""The Python side of the fused decode kernels, without a GPU: the launch plan for real layouts
(shared memory within what every card gives a block) and arguments that match the kernels'
signatures in moe_decode.cu. (The kernels' results are checked against their twins on the GPU.)"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.kernels import experts as K
from strata_mgpu.kernels import nvrtc
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.quant.formats import block_format

SHARED_LIMIT = 48 * 1024  # what a block gets without opting in


def layout(gate_type: Q, down_type: Q, d: int, f: int) -> ExpertLayout:
    def nbytes(t: Q, n: int) -> int:
        fmt = block_format(t)
        return n // fmt.block_size * fmt.type_size

    return ExpertLayout(gate_type=gate_type, down_type=down_type, gate_bytes=nbytes(gate_type, f * d),
                        down_bytes=nbytes(down_type, d * f), gate_weights=f * d, down_weights=d * f)


def fake_kernels() -> K.CudaKernels:
    # no CuPy, no device, nothing compiled: only the launch arithmetic is used
    return K.CudaKernels(torch.device("cpu"), K.CardCapabilities(host_pointers=True, grouped_mm=False,
                                                                  grouped_mm_sync_free=False, multiprocessors=132))


def kernel_params(name: str, file: str = K.MOE_FILE) -> int:
    """Parameters of kernel `name` in cuda_src/`file`, counted from its signature."""
    src = nvrtc.cuda_source(file)
    sig = re.search(rf"__global__ void {name}\((.*?)\)\s*{{", src, re.S)
    assert sig, name
    return sig.group(1).count(",") + 1


def test_plans_of_real_layouts_fit_shared_memory():
    k = fake_kernels()
    # Qwen3-30B-A3B (D 2048, F 768, A 8) and Qwen3-235B-A22B (D 4096, F 1536, A 8) in the usual types
    for d, f in ((2048, 768), (4096, 1536)):
        for gate, down in ((Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0), (Q.Q5_K, Q.Q6_K), (Q.F16, Q.F16), (Q.BF16, Q.BF16),
                           (Q.Q2_K, Q.Q3_K), (Q.Q3_K, Q.Q4_K), (Q.IQ4_XS, Q.IQ4_NL), (Q.MXFP4, Q.MXFP4),
                           (Q.Q4_0, Q.Q8_0), (Q.Q4_1, Q.Q5_1), (Q.Q5_0, Q.Q6_K)):
            plan = k.moe_fused(layout(gate, down, d, f), d, 8)
            if plan is None and d == 4096 and down in (Q.F16, Q.BF16):
                continue  # eight 1,536-value vectors and eight 3 KB rows: over 48 KiB (the twin runs)
            assert plan is not None and plan.ffn == f
            assert plan.gate_up_shared == 2 * K._tile_room(plan.rows_gu * plan.gate_row) + K._vector_bytes(d, gate)
            assert plan.down_shared == K._down_shared(plan.rows_down, plan.down_row, f, 8, down)
            assert max(plan.gate_up_shared, plan.down_shared) <= SHARED_LIMIT
            assert (plan.q8_gate_up, plan.q8_down) == (gate in K.Q8_DOT_TYPES, down in K.Q8_DOT_TYPES)
            assert 1 <= plan.rows_gu <= K.MOE_THREADS // 32 and 1 <= plan.rows_down <= K.MOE_THREADS // 32
    plan = k.moe_fused(layout(Q.Q4_K, Q.Q6_K, 2048, 768), 2048, 8)
    # 7 down rows a block: the quantized vectors take less shared memory than bf16 ones
    assert plan[:5] == (768, 1152, 630, 8, 7) and plan.q8_gate_up and plan.q8_down
    assert k.moe_fused(layout(Q.F32, Q.F32, 4096, 1536), 4096, 8) is None  # a row tile over shared memory


def test_a_type_without_fused_kernels_gets_no_plan(monkeypatch):
    from dataclasses import replace

    from strata_mgpu.quant import formats

    monkeypatch.setitem(formats.FORMATS, Q.IQ4_XS, replace(formats.FORMATS[Q.IQ4_XS], fused_decode=False))
    k = fake_kernels()
    assert k.moe_fused(layout(Q.IQ4_XS, Q.Q6_K, 2048, 768), 2048, 8) is None
    assert k.moe_fused(layout(Q.Q6_K, Q.IQ4_XS, 2048, 768), 2048, 8) is None
    assert k.moe_fused(layout(Q.Q4_K, Q.Q6_K, 2048, 768), 2048, 8) is not None


def test_launches_match_the_kernel_signatures(monkeypatch):
    launches = []
    monkeypatch.setattr(nvrtc, "kernel", lambda file, expr, exprs, device, defines=(): expr)
    monkeypatch.setattr(nvrtc, "launch", lambda fn, grid, block, args, device, shared_mem=0:
                        launches.append((fn, grid, block, args, shared_mem)))
    d, f, e, a, t = 2048, 768, 128, 8, 3
    lay = layout(Q.Q4_K, Q.Q6_K, d, f)
    cache = SimpleNamespace(slot_of=torch.full((4, e), -1, dtype=torch.int64),
                            host_offset=torch.zeros(4, e, dtype=torch.int64),
                            slots=torch.zeros(16, dtype=torch.uint8), slot_bytes=lay.expert_bytes, per_layer=0,
                            host=torch.zeros(16, dtype=torch.uint8))
    h = torch.zeros(t, d, dtype=torch.bfloat16)
    experts = torch.randint(0, e, (t, a))
    out = fake_kernels().moe_gathered(cache, 2, lay, h, torch.rand(t, a), experts, None, None)
    assert out.shape == (t, d) and out.dtype == torch.bfloat16
    (q1_fn, q1_grid, _, q1_args, _), (gu_fn, gu_grid, gu_block, gu_args, gu_smem), \
        (q2_fn, q2_grid, _, q2_args, _), (dn_fn, dn_grid, dn_block, dn_args, dn_smem) = launches
    # Q4_K and Q6_K dot integers: h, then the activations, quantized first (a warp a 32-value run)
    assert q1_fn == q2_fn == "quantize_q8" and len(q1_args) == len(q2_args) == kernel_params("quantize_q8")
    assert (q1_grid, q1_args[1]) == (-(-t * d // 32 // 8), t * d // 32) and q2_args[1] == t * a * f // 32
    assert gu_args[1] == q1_args[2] and dn_args[1] == q2_args[2]  # each kernel reads its quantized input
    assert gu_fn == "moe_gate_up<12>" and gu_grid == (f // 8, t * a) and len(gu_args) == kernel_params("moe_gate_up")
    assert dn_fn == "moe_down<14>" and dn_grid == (-(-d // 7), t) and len(dn_args) == kernel_params("moe_down")
    assert gu_block == dn_block == K.MOE_THREADS and max(gu_smem, dn_smem) <= SHARED_LIMIT
    assert gu_args[4] == cache.slot_of.data_ptr() + 8 * 2 * e  # layer 2's row of the table


def test_routing_is_one_launch_that_matches_its_signature(monkeypatch):
    """route_rows computes the logits and (its last block a row) the top-k: one launch, its
    arguments those of the kernel in decode_ops.cu, the rows' counters the ops' own."""
    from strata_mgpu.kernels import decode_ops as DO
    from strata_mgpu.kernels.paths import PathCounter

    ops = DO.CudaDecodeOps.__new__(DO.CudaDecodeOps)  # no CuPy, no device: only the launch arithmetic
    ops.device, ops.paths = torch.device("cpu"), PathCounter()
    ops.rows_done = torch.zeros(DO.MAX_ROUTED_ROWS, dtype=torch.int32)
    launches = []
    monkeypatch.setattr(DO.CudaDecodeOps, "_ok", staticmethod(lambda *t: True))
    monkeypatch.setattr(ops, "_launch", lambda name, grid, block, *args, shared_mem=0:
                        launches.append((name, grid, block, args)))
    t, e, d, a = 3, 128, 2048, 8
    weights, experts = ops.route(torch.zeros(t, d, dtype=torch.bfloat16), torch.zeros(e, d), a, True)
    assert weights.shape == experts.shape == (t, a) and experts.dtype == torch.int64
    [(name, grid, block, args)] = launches
    src = nvrtc.cuda_source(DO.OPS_FILE)
    sig = re.search(r"__global__ void route_rows\((.*?)\)\s*{", src, re.S)
    assert name == "route_rows" and sig and len(args) == sig.group(1).count(",") + 1
    assert grid == (-(-e // DO.ROUTER_WARPS), t) and block == 32 * DO.ROUTER_WARPS
    assert args[-1] == ops.rows_done.data_ptr() and args[5:7] == (a, 1)


def test_the_moe_input_is_one_launch_that_matches_its_signature(monkeypatch):
    """moe_input_rows: the residual add and norm (into new tensors: other blocks still read x),
    the routing and h quantized, one launch; its blocks as wide as add_rms_norm_rows' so that h
    sums in the same order."""
    from strata_mgpu.kernels import decode_ops as DO
    from strata_mgpu.kernels.paths import PathCounter

    assert DO.NORM_THREADS == 32 * DO.ROUTER_WARPS
    ops = DO.CudaDecodeOps.__new__(DO.CudaDecodeOps)
    ops.device, ops.paths = torch.device("cpu"), PathCounter()
    ops.rows_done = torch.zeros(DO.MAX_ROUTED_ROWS, dtype=torch.int32)
    launches = []
    monkeypatch.setattr(DO.CudaDecodeOps, "_ok", staticmethod(lambda *t: True))
    monkeypatch.setattr(ops, "_launch", lambda name, grid, block, *args, shared_mem=0:
                        launches.append((name, grid, block, args, shared_mem)))
    t, e, d, a = 2, 128, 2048, 8
    x, y = torch.zeros(t, d, dtype=torch.bfloat16), torch.zeros(t, d, dtype=torch.bfloat16)
    x_out, h, weights, experts, hq = ops.moe_input(x, y, torch.ones(d, dtype=torch.bfloat16), 1e-6,
                                                   torch.zeros(e, d), a, False)
    assert x_out.data_ptr() != x.data_ptr() and h.shape == x.shape and weights.shape == experts.shape == (t, a)
    assert hq is not None and hq.shape == (t, d // 32 * K.Q8_WORDS) and hq.dtype == torch.int32
    [(name, grid, block, args, smem)] = launches
    src = nvrtc.cuda_source(DO.OPS_FILE)
    sig = re.search(r"__global__ void moe_input_rows\((.*?)\)\s*{", src, re.S)
    assert name == "moe_input_rows" and sig and len(args) == sig.group(1).count(",") + 1
    assert grid == (-(-e // DO.ROUTER_WARPS), t) and block == DO.NORM_THREADS and smem == 4 * d
    assert args[-4:] == (ops.rows_done.data_ptr(), x_out.data_ptr(), h.data_ptr(), hq.data_ptr())


def test_the_twin_moe_input_is_add_rms_norm_then_route():
    from strata_mgpu.model.ops import DecodeOps

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    w, router = torch.rand(64, generator=g), torch.randn(16, 64, generator=g)
    ops = DecodeOps()
    x2, h, weights, experts, hq = ops.moe_input(x, y, w, 1e-6, router, 4, True)
    x_want, h_want = ops.add_rms_norm(x, y, w, 1e-6)
    w_want, e_want = ops.route(h_want, router, 4, True)
    assert hq is None and torch.equal(x2, x_want) and torch.equal(h, h_want)
    assert torch.equal(weights, w_want) and torch.equal(experts, e_want)


def test_dense_rows_a_warp_grow_with_x_while_the_grid_fills_the_card():
    from strata_mgpu.kernels.dense import w_rows_a_warp

    sms = 132  # an H200's
    assert w_rows_a_warp(1, 151_936, sms) == 1  # one vector: the bytes bound it, every warp in flight
    assert [w_rows_a_warp(t, 151_936, sms) for t in (2, 3, 4, 8)] == [2, 2, 4, 4]  # a head: 4 rows a warp
    assert w_rows_a_warp(8, 5_120, sms) == 2  # q/k/v: 320 blocks at 2, 160 at 4
    assert w_rows_a_warp(8, 2_048, sms) == 1  # o: 256 blocks already
    assert w_rows_a_warp(8, 2_048, 16) == 4  # a smaller card fills sooner


def test_dense_projection_launches_take_at_most_what_shared_memory_holds(monkeypatch):
    """dense_q8: x quantized once, then one launch every few rows (8, or fewer for a wide x), each
    with the kernel's arguments; types without an integer dot are refused in one line."""
    from strata_mgpu.kernels import dense

    launches = []
    monkeypatch.setattr(nvrtc, "kernel", lambda file, expr, exprs, device, defines=(): expr)
    monkeypatch.setattr(nvrtc, "launch", lambda fn, grid, block, args, device, shared_mem=0:
                        launches.append((fn, grid, block, args, shared_mem)))
    k = fake_kernels()
    src = nvrtc.cuda_source(dense.DENSE_FILE)
    assert f"constexpr int DENSE_MAX_ROWS = {dense.DENSE_MAX_ROWS};" in src
    n_params = re.search(r"__global__ void dense_q8\((.*?)\)\s*{", src, re.S).group(1).count(",") + 1
    for t, kdim, n, per in ((1, 2048, 5120, 8), (11, 2048, 5120, 8), (8, 4096, 2048, 8), (8, 8192, 4096, 4)):
        launches.clear()
        raw = torch.zeros(n, block_format(Q.Q8_0).row_bytes(kdim), dtype=torch.uint8)
        out = dense.dense_q8(k, torch.zeros(t, kdim, dtype=torch.bfloat16), raw, Q.Q8_0)
        assert out.shape == (t, n) and dense.rows_a_launch(kdim) == per
        quantize, *runs = launches
        assert quantize[0] == "quantize_q8" and len(runs) == -(-t // per)
        rows = [min(per, t - i) for i in range(0, t, per)]
        assert [args[1] for *_, args, _ in runs] == rows
        for (fn, grid, _, args, _), x_rows in zip(runs, rows, strict=True):
            r = dense.w_rows_a_warp(x_rows, n, k.multiprocessors)
            assert fn == f"dense_q8<8, {r}>" and len(args) == n_params and grid == -(-n // (8 * r))
        assert all(smem <= dense.DENSE_SHARED_BYTES for *_, smem in runs)
    raw = torch.zeros(4, block_format(Q.IQ4_XS).row_bytes(256), dtype=torch.uint8)
    with pytest.raises(ValueError, match="dense_q8 takes"):
        dense.dense_q8(k, torch.zeros(1, 256, dtype=torch.bfloat16), raw, Q.IQ4_XS)
    with pytest.raises(ValueError, match="dense_q8 takes"):  # not whole blocks, not a ZeroDivisionError
        dense.dense_q8(k, torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(4, 17, dtype=torch.uint8), Q.Q8_0)
    launches.clear()
    raw = torch.zeros(64, block_format(Q.Q8_0).row_bytes(256), dtype=torch.uint8)
    assert dense.dense_q8(k, torch.zeros(0, 256, dtype=torch.bfloat16), raw, Q.Q8_0).shape == (0, 64)
    assert not launches  # no rows: no launch


def test_the_dense_twin_is_the_quantized_input_times_the_weights():
    """dense_reference against a float64 product of the same quantized input and dequantized rows."""
    from strata_mgpu.kernels import dense
    from strata_mgpu.kernels.experts import q8_values
    from strata_mgpu.quant.dequant import dequantize_rows
    from tests.test_quant import raw_blocks

    rng = np.random.default_rng(3)
    kdim, n = 512, 24
    raw = torch.from_numpy(raw_blocks(Q.Q4_K, n * kdim // 256, rng).view(np.uint8).reshape(n, -1).copy())
    x = torch.from_numpy(rng.standard_normal((3, kdim)).astype(np.float32)).bfloat16()
    got = dense.dense_reference(x, raw, Q.Q4_K)
    want = q8_values(x).double() @ dequantize_rows(raw, Q.Q4_K, kdim).double().T
    assert got.dtype == torch.bfloat16 and got.shape == (3, n)
    assert torch.allclose(got.double(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
