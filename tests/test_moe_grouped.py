"""The Python side of the grouped expert kernels (`kernels/moe_grouped.py`), without a GPU: the
picks' order and bounds by expert, when a gathered pass goes expert by expert, and launches whose
arguments match the kernels' signatures in moe_grouped.cu. (Their results are checked on the GPU:
tests/test_gpu_quant.py, bit for bit against decode's pick-by-pick kernels.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.kernels import experts as K
from strata_mgpu.kernels import moe_grouped as G
from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.q8 import Q8_DOT_TYPES
from tests.test_kernel_launch import SHARED_LIMIT, fake_kernels, kernel_params, layout


def grouped_params(name: str) -> int:
    return kernel_params(name, G.GROUPED_FILE)


def test_picks_by_expert_lists_each_experts_picks_in_order():
    g = torch.Generator().manual_seed(0)
    n_experts = 16
    picks = torch.randint(0, n_experts - 3, (200,), generator=g)  # the last three experts never picked
    order, starts = G.picks_by_expert(picks, torch.arange(n_experts + 1))
    assert starts.shape == (n_experts + 1,) and starts[0] == 0 and starts[-1] == picks.numel()
    for e in range(n_experts):
        mine = order[starts[e]:starts[e + 1]]
        assert torch.equal(mine, (picks == e).nonzero().flatten())  # every pick of e, ascending
    assert torch.equal(torch.sort(order).values, torch.arange(picks.numel()))


def test_vectors_a_batch_fit_shared_memory():
    for width in (256, 768, 1536, 2048, 4096, 7168):
        n = G.vectors_a_batch(width, K.Q8_WORDS)
        assert 1 <= n <= G.GROUP_VECTORS and n * width // 32 * K.Q8_WORDS * 4 <= G.GROUP_SHARED_BYTES
    assert G.vectors_a_batch(2048, K.Q8_WORDS) == 8 and G.vectors_a_batch(4096, K.Q8_WORDS) == 7


def _gathered(monkeypatch, lay, t: int, a: int, d: int, e: int = 128, resident: int = 128):
    launches = []
    monkeypatch.setattr(nvrtc, "kernel", lambda file, expr, exprs, device, defines=(): (file, expr))
    monkeypatch.setattr(nvrtc, "launch", lambda fn, grid, block, args, device, shared_mem=0:
                        launches.append((fn, grid, block, args, shared_mem)))
    k = fake_kernels()
    k._expert_ids = torch.arange(K.MAX_EXPERTS + 1)
    cache = SimpleNamespace(slot_of=torch.full((2, e), -1, dtype=torch.int64),
                            host_offset=torch.zeros(2, e, dtype=torch.int64),
                            slots=torch.zeros(16, dtype=torch.uint8), slot_bytes=lay.expert_bytes,
                            host=torch.zeros(16, dtype=torch.uint8), per_layer=resident)
    out = k.moe_gathered(cache, 1, lay, torch.zeros(t, d, dtype=torch.bfloat16), torch.rand(t, a),
                         torch.randint(0, e, (t, a)), None, None)
    assert out.shape == (t, d) and out.dtype == torch.bfloat16
    return k, cache, launches


def test_enough_picks_go_expert_by_expert_with_the_kernels_signatures(monkeypatch):
    d, f, a, e = 2048, 768, 8, 128
    t = G.GROUPED_MIN_PICKS // a
    k, cache, launches = _gathered(monkeypatch, layout(Q.Q4_K, Q.Q6_K, d, f), t, a, d, e)
    assert k.paths["moe_gathered:grouped"] == 1 and k.paths["moe_gathered:fused"] == 0
    names = [fn[1] for fn, *_ in launches]
    assert names == ["quantize_q8", "moe_group_gate_up<12>", "quantize_q8", "moe_group_down<14>",
                     "moe_group_combine"]
    (_, _, _, hq_args, _), (_, gu_grid, gu_block, gu_args, gu_smem), (_, _, _, aq_args, _), \
        (_, dn_grid, dn_block, dn_args, dn_smem), (_, cb_grid, _, cb_args, _) = launches
    assert len(gu_args) == grouped_params("moe_group_gate_up") and len(dn_args) == grouped_params("moe_group_down")
    assert len(cb_args) == grouped_params("moe_group_combine")
    warps = G.GROUP_THREADS // 32
    assert gu_grid == (f // warps, e) and dn_grid == (d // warps, e) and gu_block == dn_block == G.GROUP_THREADS
    assert gu_args[0] == hq_args[2] and dn_args[0] == aq_args[2]  # each reads its quantized input
    assert gu_args[1] == dn_args[1] and gu_args[2] == dn_args[2]  # one order, one set of bounds
    assert gu_args[4] == 8 and gu_smem == 8 * (d // 32) * K.Q8_WORDS * 4 <= SHARED_LIMIT
    assert dn_smem == dn_args[3] * (f // 32) * K.Q8_WORDS * 4 <= SHARED_LIMIT
    assert gu_args[5] == cache.slot_of.data_ptr() + 8 * 1 * e  # layer 1's row of the table
    assert cb_grid == -(-t * d // G.COMBINE_THREADS) and cb_args[3] == t * d


def test_few_picks_or_a_float_side_stay_pick_by_pick(monkeypatch):
    d, f, a = 2048, 768, 8
    k, _, launches = _gathered(monkeypatch, layout(Q.Q4_K, Q.Q6_K, d, f), G.GROUPED_MIN_PICKS // a - 1, a, d)
    assert k.paths["moe_gathered:fused"] == 1 and "moe_gate_up<12>" in [fn[1] for fn, *_ in launches]
    k, _, launches = _gathered(monkeypatch, layout(Q.Q4_K, Q.F16, d, f), 64, a, d)  # float down: no grouped kernel
    assert k.paths["moe_gathered:fused"] == 1 and k.paths["moe_gathered:grouped"] == 0
    k, _, launches = _gathered(monkeypatch, layout(Q.Q4_K, Q.Q6_K, d, f), 64, a, d, resident=100)  # some on the host
    assert k.paths["moe_gathered:fused"] == 1 and k.paths["moe_gathered:grouped"] == 0


def test_the_kernels_are_compiled_with_their_launchers_vectors_a_batch(monkeypatch):
    """moe_grouped.cu has no GROUP_VECTORS of its own (tests/test_nvrtc_compile.py sees it refused
    without one): every kernel of it is loaded with the launcher's."""
    loaded = []
    monkeypatch.setattr(nvrtc, "kernel", lambda file, expr, exprs, device, defines=(): loaded.append((file, defines)))
    for expr in (*G.grouped_exprs(Q8_DOT_TYPES), *G.GROUPED_NAMES):
        G.grouped_kernel(expr, torch.device("cpu"))
    assert set(loaded) == {(G.GROUPED_FILE, (("GROUP_VECTORS", G.GROUP_VECTORS),))}
