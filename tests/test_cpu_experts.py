"""The CPU expert executor (kernels/cpu_experts.py): ggml over the arena's bytes against its twins on
every served type, rows split across graphs and threads changing nothing; the CPU stage that
computes its experts with it (`--devices cpu`) against the fp32 reference; its threads; its
fallback where ggml-python is missing.

Tolerances, max|diff| / max|reference|, measured on this file's random layers (D = F = 256; 42
seeds a type, the tests' own shapes; the bounds carry a margin of 2-7x over the worst seen):
- against the plain twin (dequantize + fp32 matmul): ggml quantizes each matmul's input to the
  weight type's vec_dot type, so the outputs differ by that rounding: Q8_K types (K-quants, IQ,
  TQ) 2.4-3.8e-2, Q8_0/Q8_1 types 1.4-1.9e-2, BF16 4.2e-3, F16 1.9e-3, F32 4e-7;
- against the rounding twin (tests/ggml_rounding.py: the inputs rounded as ggml rounds them), row
  by row (one pick a row): the median row 1-3e-7 for most types (fp32 sums in another order); a
  row now and then up to 5e-3 where an activation fed to down lies at a rounding boundary and its
  last fp32 bit differs (so the median row is bounded tightly, the worst row loosely); Q4_1/Q5_1
  3.7e-3, worst row 9.8e-3 (ggml keeps Q8_1's block sums in fp16); F16 1.4e-3, worst 2e-3 (fp16
  products and sums on CPUs with AVX512-FP16, as this one).
The same executor multiplies a CPU stage's projections from their blocks (`matmul`): below
DEQUANT_ROWS rows through ggml_mul_mat, its input rounded as above, so within the same bounds; from
there W dequantized by ggml and multiplied by torch in fp32, so within FP32_TOL of the twin.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.cli import main
from strata_mgpu.config import Placement
from strata_mgpu.engine.build import build_runner
from strata_mgpu.kernels import cpu_experts
from strata_mgpu.kernels.cpu_experts import DEQUANT_ROWS, GgmlExperts, TorchExperts, default_threads, physical_cores
from strata_mgpu.kernels.paths import _warned
from strata_mgpu.kernels.run_queue import ThreadPace
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.reference import moe_reference
from strata_mgpu.model.runner import DecoderRunner, load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import TensorPlan, make_tensor, write_model
from strata_mgpu.model.weights import BlockMatrix, load_weights
from strata_mgpu.quant.dequant import dequantize_rows
from strata_mgpu.quant.formats import SUPPORTED_TYPES, block_format
from strata_mgpu.stage.build import build_stage, dense_storage_bytes
from strata_mgpu.stage.experts.host_cores import HostCoreExperts
from strata_mgpu.stage.stage import Stage, StageOptions
from tests.ggml_rounding import VEC_DOT, RoundingTwin
from tests.test_quant import fresh_seed
from tests.test_quant_stage import PAIRS

CPU = torch.device("cpu")
D = F = 256
E, A = 8, 2
# against the plain twin, by the type ggml rounds the inputs to
TWIN_TOL = {Q.Q8_K: 8e-2, Q.Q8_0: 5e-2, Q.Q8_1: 5e-2, Q.BF16: 1e-2, Q.F16: 1e-2, Q.F32: 1e-5}
ROUNDED_MEDIAN_TOL = {Q.Q4_1: 2e-2, Q.Q5_1: 2e-2, Q.F16: 1e-2}  # the rest: ROUNDED_TOL
ROUNDED_TOL = 1e-5
ROUNDED_WORST_TOL = 2e-2  # a row with an activation at a rounding boundary
# The CPU stage's logits (the tiny model, 4 layers, every pair of types, 3 prompts, prefill and 3
# decode steps): with ggml against the fp32 reference, 1e-3 (F16/F32) to 0.2 (IQ2_S/TQ1_0), most
# pairs 1-6e-2: beyond the executor's own error a row near a router decision picks another expert
# (a routing flip), in that layer and, through attention, at later positions; against the same
# stage with the rounding twin, 3e-7 to 7.9e-3 (Q4_0/Q4_1: Q8_1's fp16 sums); with the plain twin
# as its executor against the reference, 4.5e-7.
STAGE_TOL = 0.5
FP32_TOL = 1e-5  # as tests/test_stage.py

ggml_needed = pytest.mark.skipif(cpu_experts.ggml_missing() is not None, reason="ggml-python is not installed")


def random_layer(gate_type: Q, down_type: Q, seed: int) -> tuple[torch.Tensor, ExpertLayout]:
    """E experts of valid random blocks in the arena's layout: uint8 [E * expert_bytes]."""
    gate_bytes = block_format(gate_type).row_bytes(D) * F
    down_bytes = block_format(down_type).row_bytes(F) * D
    lay = ExpertLayout(gate_type=gate_type, down_type=down_type, gate_bytes=gate_bytes, down_bytes=down_bytes,
                       gate_weights=F * D, down_weights=D * F)
    gate_up = make_tensor(TensorPlan("gate_up", (E, 2 * F, D), gate_type, std=D ** -0.5), seed)
    down = make_tensor(TensorPlan("down", (E, D, F), down_type, std=F ** -0.5), seed)
    parts = [gate_up.reshape(E, -1).view(np.uint8), down.reshape(E, -1).view(np.uint8)]
    return torch.from_numpy(np.concatenate(parts, axis=1).reshape(-1)), lay


def random_rows(t: int, n_used: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [t, D] of rows of different scales, weights [t, A], experts [t, A] (distinct in a row)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, D, generator=g) * (0.5 + 4 * torch.rand(t, 1, generator=g))
    experts = torch.stack([torch.randperm(E, generator=g)[:n_used] for _ in range(t)])
    return h, torch.rand(t, n_used, generator=g), experts


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def row_errs(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (a - ref).abs().amax(1) / ref.abs().amax(1)


@pytest.fixture(scope="module")
def executor():
    return GgmlExperts(2) if cpu_experts.ggml_missing() is None else None


@ggml_needed
def test_the_rounding_table_is_ggml_s():
    import ggml

    for t in SUPPORTED_TYPES:
        assert Q(ggml.ggml_get_type_traits_cpu(int(t)).contents.vec_dot_type) == VEC_DOT[t], t.name


@ggml_needed
@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_ggml_equals_the_twins(executor, ggml_type):
    seed = fresh_seed()
    layer, lay = random_layer(ggml_type, ggml_type, seed)
    h, weights, experts = random_rows(12, A, seed)
    got = executor.moe(layer, lay, h, weights, experts)
    twin = TorchExperts().moe(layer, lay, h, weights, experts)
    assert got.shape == (12, D) and got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel_err(got, twin) <= TWIN_TOL[VEC_DOT[ggml_type]], f"seed {seed}"
    # one pick a row, so each row is one expert's output: rounded as ggml rounds, row by row
    h, weights, experts = random_rows(16, 1, seed + 1)
    errs = row_errs(executor.moe(layer, lay, h, weights, experts), RoundingTwin().moe(layer, lay, h, weights, experts))
    median_tol = ROUNDED_MEDIAN_TOL.get(ggml_type, ROUNDED_TOL)
    assert float(errs.median()) <= median_tol and float(errs.max()) <= max(ROUNDED_WORST_TOL, median_tol), \
        f"seed {seed}: rows {errs.tolist()}"


@ggml_needed
@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_ggml_matmul_equals_the_twins(executor, ggml_type):
    """x [T, K] times a projection W [N, K] kept as blocks, at a decode step's rows, a few, and a
    prompt's (the dequantizing path): against the plain twin within the input's rounding (fp32
    alike from DEQUANT_ROWS on), against the rounding twin row by row."""
    seed = fresh_seed()
    n, k = 96, 2 * D
    raw = torch.from_numpy(np.ascontiguousarray(
        make_tensor(TensorPlan("w", (n, k), ggml_type, std=k ** -0.5), seed).reshape(n, -1).view(np.uint8)))
    g = torch.Generator().manual_seed(seed)
    for rows in (1, 5, DEQUANT_ROWS):
        x = torch.randn(rows, k, generator=g) * (0.5 + 4 * torch.rand(rows, 1, generator=g))
        got = executor.matmul(x, raw, ggml_type, k)
        twin = TorchExperts().matmul(x, raw, ggml_type, k)
        assert got.shape == (rows, n) and got.dtype == torch.float32 and torch.isfinite(got).all()
        tol = FP32_TOL if rows >= DEQUANT_ROWS else TWIN_TOL[VEC_DOT[ggml_type]]
        assert rel_err(got, twin) <= tol, f"seed {seed}, {rows} rows"
        errs = row_errs(got, RoundingTwin().matmul(x, raw, ggml_type, k))
        median_tol = ROUNDED_MEDIAN_TOL.get(ggml_type, ROUNDED_TOL)
        assert float(errs.median()) <= median_tol and float(errs.max()) <= max(ROUNDED_WORST_TOL, median_tol), \
            f"seed {seed}, {rows} rows: {errs.tolist()}"
    for rows in (1, DEQUANT_ROWS):  # rows of another width than W's bytes hold: refused, not read past
        with pytest.raises(AssertionError, match=f"rows of {k + 256} values take"):
            executor.matmul(torch.randn(rows, k + 256), raw, ggml_type, k + 256)


@ggml_needed
def test_a_serving_stage_s_projection_graphs_stay_built(monkeypatch):
    """A CPU stage that serves meets every decode batch size and short prompt length: each
    projection's graph for each row count below DEQUANT_ROWS is built once and kept (its experts'
    graphs beside, not evicting them), so a step rebuilds nothing."""
    built = []

    class Counted(cpu_experts._MatmulGraph):
        def __init__(self, *args, **kwargs):
            built.append(args[2:5])  # (K, N, rows)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cpu_experts, "_MatmulGraph", Counted)
    executor = GgmlExperts(1)
    shapes = [(32, D), (48, D), (64, 2 * D), (16, D)]  # N, K: as q/k/v, o and the head of a small model
    mats = [torch.from_numpy(np.ascontiguousarray(make_tensor(TensorPlan(f"w{i}", (n, k), Q.Q8_0, std=0.1), i)
                                                  .reshape(n, -1).view(np.uint8))) for i, (n, k) in enumerate(shapes)]
    layer, lay = random_layer(Q.Q4_K, Q.Q6_K, 1)
    for _ in range(2):
        for rows in range(1, DEQUANT_ROWS):
            for (_, k), raw in zip(shapes, mats, strict=True):
                executor.matmul(torch.randn(rows, k), raw, Q.Q8_0, k)
        h, weights, experts = random_rows(1, A, 1)
        executor.moe(layer, lay, h, weights, experts)
    assert len(built) == len(shapes) * (DEQUANT_ROWS - 1) == len(set(built))  # the second round built none
    executor.close()


def test_the_twin_is_the_reference_moe():
    """The twin over the arena's bytes equals the oracle's experts over the same weights dequantized."""
    layer, lay = random_layer(Q.Q4_K, Q.Q6_K, 3)
    by_expert = layer.view(E, -1)
    gate_up = torch.stack([dequantize_rows(x[:2 * lay.gate_bytes].reshape(2 * F, -1), Q.Q4_K, D) for x in by_expert])
    down = torch.stack([dequantize_rows(x[lay.down_offset:].reshape(D, -1), Q.Q6_K, F) for x in by_expert])
    w = SimpleNamespace(gate=gate_up[:, :F], up=gate_up[:, F:], down=down)  # the layer's experts, as LayerWeights
    h, weights, experts = random_rows(9, A, 4)
    ref = moe_reference(h, w, weights, experts)
    assert rel_err(TorchExperts().moe(layer, lay, h, weights, experts), ref) <= 1e-5


@ggml_needed
def test_rows_over_many_graphs_and_threads_change_nothing(executor):
    """A prompt's rows go through graphs of ROWS_A_GRAPH rows; each row's output is its own (ggml
    quantizes row by row), so one call equals a call a row, on one thread as on two."""
    layer, lay = random_layer(Q.Q4_K, Q.Q6_K, 5)
    t = cpu_experts.ROWS_A_GRAPH + 37
    h, weights, experts = random_rows(t, A, 6)
    whole = executor.moe(layer, lay, h, weights, experts)
    one = GgmlExperts(1)
    for r in (0, 1, cpu_experts.ROWS_A_GRAPH - 1, cpu_experts.ROWS_A_GRAPH, t - 1):
        assert torch.equal(one.moe(layer, lay, h[r:r + 1], weights[r:r + 1], experts[r:r + 1])[0], whole[r]), r
    assert torch.equal(one.moe(layer, lay, h, weights, experts), whole)


@ggml_needed
def test_fewer_of_the_pool_s_threads_change_nothing():
    """A paced executor computes on k of the pool's threads in graphs planned for all of them: the
    plan's work buffer fits (its size grows with the threads planned for), and every output, the
    experts' and a projection's, is bit for bit the one on all of them (each output element is
    one thread's dot over the whole row, whichever thread)."""
    import ggml

    layer, lay = random_layer(Q.Q4_K, Q.Q6_K, 9)
    sizes = [cpu_experts._MoeGraph(ggml, lay, D, E, A, 3, n, None).plan.work_size for n in (1, 2, 4, 8)]
    assert sizes == sorted(sizes)
    h, weights, experts = random_rows(3, A, 10)
    raw = torch.from_numpy(np.ascontiguousarray(
        make_tensor(TensorPlan("w", (96, D), Q.Q8_0, std=D ** -0.5), 11).reshape(96, -1).view(np.uint8)))
    paced = GgmlExperts(4, pace=ThreadPace(4, adaptive=False))
    want = paced.moe(layer, lay, h, weights, experts), paced.matmul(h, raw, Q.Q8_0, D)
    for k in (1, 2, 3):
        paced.pace.threads = k  # as the policy would set it
        assert paced.threads_now == k
        got = paced.moe(layer, lay, h, weights, experts), paced.matmul(h, raw, Q.Q8_0, D)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), k
        assert all(g.plan.n_threads == k for g in [*paced._graphs.values(), *paced._matmuls.values()])
    paced.close()


@ggml_needed
def test_the_rates_count_each_call_s_distinct_experts(executor):
    layer, lay = random_layer(Q.Q8_0, Q.Q8_0, 7)
    executor.reset_rates()
    h, weights, _ = random_rows(3, A, 8)
    experts = torch.tensor([[0, 1], [1, 2], [0, 2]])
    executor.moe(layer, lay, h, weights, experts)
    executor.moe(layer, lay, h[:1], weights[:1], experts[:1])
    assert set(executor.rates) == {3, 1}
    three, one = executor.rates[3], executor.rates[1]
    assert (three.calls, three.expert_bytes, one.calls, one.expert_bytes) == (1, 3 * lay.expert_bytes, 1,
                                                                              2 * lay.expert_bytes)
    assert executor.rate.calls == 2 and executor.rate.seconds == three.seconds + one.seconds > 0
    assert executor.rate.gb_per_s == pytest.approx(5 * lay.expert_bytes / executor.rate.seconds / 1e9)


def test_threads_default_to_the_physical_cores_less_the_gpu_stages():
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))
    assert default_threads(0, cores=8) == 8 and default_threads(2, cores=8) == 5 and default_threads(3, cores=2) == 1
    assert default_threads(0) == physical_cores()
    with pytest.raises(ValueError, match="--threads 0"):
        Placement(threads=0)


def test_without_ggml_the_twin_runs_and_says_so_once(monkeypatch, caplog, tiny_gguf):
    monkeypatch.setitem(sys.modules, "ggml", None)  # `import ggml` raises ImportError
    _warned.clear()
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        assert isinstance(cpu_experts.select_cpu_experts(2), TorchExperts)
        assert isinstance(cpu_experts.select_cpu_experts(2), TorchExperts)
    said = [r.getMessage() for r in caplog.records if "ggml-python is not installed" in r.getMessage()]
    assert len(said) == 1 and "strata-mgpu[cpu-experts]" in said[0], caplog.text
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_runner(f, spec, Placement(devices=("cpu",)), 64, kv_tokens=128)  # bench's: the stage, on the twin
    assert isinstance(stage, Stage) and isinstance(stage.experts.executor, TorchExperts)
    # serve's: the fp32 reference, as before the stage computed its experts in place (faster than the twin)
    assert isinstance(build_runner(f, spec, Placement(devices=("cpu",)), 64, cpu_reference=True), DecoderRunner)


@ggml_needed
def test_devices_cpu_builds_a_stage_of_arena_and_host_cores(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    for cpu_reference in (False, True):  # bench's and serve's
        stage = build_runner(f, spec, Placement(devices=("cpu",), threads=1), 64, kv_tokens=128,
                             cpu_reference=cpu_reference)
        assert isinstance(stage, Stage) and isinstance(stage.experts, HostCoreExperts)
        assert isinstance(stage.experts.executor, GgmlExperts) and stage.experts.executor.threads == 1
    assert stage.experts.cache is None and stage.experts.ring is None and not stage.arena.pinned
    # its projections, head and embedding stay as the file's blocks, counted as their bytes
    layer = stage.model.w.layers[0]
    assert all(isinstance(m, BlockMatrix) for m in (layer.wqkv, layer.wq, layer.wk, layer.wv, layer.wo,
                                                     stage.model.w.output, stage.model.w.embed))
    assert isinstance(layer.wqkv, BlockMatrix) and layer.wqkv.raw.shape == (spec.q_dim + 2 * spec.kv_dim,
                                                                          f.tensor("blk.0.attn_q.weight").row_bytes)
    floats = dense_storage_bytes(load_weights(f, spec, with_experts=False))  # fp32 copies: 4 bytes a weight
    assert stage.report.dense_bytes < 0.4 * floats  # Q8_0: 1.06
    assert stage.plan.workspace == stage.plan.ring == stage.plan.resident == 0
    assert stage.report.kernels == "torch, experts ggml on 1 thread" and stage.report.pass_bytes == 0
    with pytest.raises(ValueError, match="no ring or workspace to lend"):
        stage.lend()
    with pytest.raises(ValueError, match="takes no helper"):
        stage.attach_helper(object())  # type: ignore[arg-type]
    split = build_runner(f, spec, Placement(devices=("cpu", "cpu")), 64, kv_tokens=128)
    assert not any(s.options.host_core_experts for s in split.stages)  # a split's CPU stages: the device path's twins


@ggml_needed
def test_a_cpu_stage_s_threads_adapt_unless_switched_off(tiny_gguf):
    """--threads is the ceiling of a CPU stage's pace, torch's intra-op threads at its count;
    STRATA_ADAPT_THREADS=0 (Placement.adapt_threads) holds it there."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    before = torch.get_num_threads()
    try:
        for adapt in (True, False):
            stage = build_runner(f, spec, Placement(devices=("cpu",), threads=2, adapt_threads=adapt), 64,
                                 kv_tokens=128)
            assert isinstance(stage, Stage) and isinstance(stage.experts, HostCoreExperts)
            executor = stage.experts.executor
            assert isinstance(executor, GgmlExperts) and executor.pace is not None
            assert executor.pace.policy.ceiling == 2 and torch.get_num_threads() == executor.threads_now
            assert executor.pace.adaptive == adapt
            assert ("ggml on 2 threads (adapting, at most 2)" in stage.report.kernels) == adapt
            executor.close()
            assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


@ggml_needed
@pytest.mark.parametrize("expert_type,down_type", PAIRS, ids=lambda t: t.name)
def test_cpu_stage_agrees_with_the_reference(tmp_path, expert_type, down_type):
    """Prefill and decode logits of the CPU stage against the fp32 reference forward: with the twin
    as its executor, equal (the stage around the executor adds nothing of its own); with ggml, as
    the same stage whose executor rounds as ggml does, and near the reference (STAGE_TOL)."""
    path = tmp_path / "m.gguf"
    write_model(path, "tiny", expert_type=expert_type, down_type=down_type, seed=int(expert_type) + 200)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    stage = stage_against_the_reference(f, spec, 9, seed=int(expert_type))
    assert stage.kernels.paths["cpu_experts:ggml"] == spec.n_layers * 4  # the prompt, then three steps


def stage_against_the_reference(f: GGUFFile, spec, prompt_tokens: int, seed: int,
                                check: Callable[[Stage], None] = lambda stage: None) -> Stage:
    """A CPU stage (ggml), the same with the rounding twin and with the plain twin as executor, and
    the fp32 reference: a prompt of `prompt_tokens` and three decode steps, their logits held to
    FP32_TOL (plain twin), ROUNDED_WORST_TOL (rounding twin) and STAGE_TOL (ggml against the
    reference). `check` looks at the stage first. Returns the ggml stage."""
    cells = prompt_tokens + 16
    opts = StageOptions(device=CPU, host_core_experts=True, threads=2, kv_tokens=2 * cells, context=2 * cells,
                        chunk_size=2 * cells)
    runners = [load_reference_runner(f, spec), build_stage(f, spec, opts), build_stage(f, spec, opts),
               build_stage(f, spec, opts)]
    ref, stage, rounded, twin = runners
    rounded.experts.executor, twin.experts.executor = RoundingTwin(), TorchExperts()
    check(stage)
    prompt = torch.randint(0, spec.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(seed))
    kvs = [r.new_sequence(cells) for r in runners]
    logits = [r.prefill(kv, prompt) for r, kv in zip(runners, kvs, strict=True)]
    for step in range(3):
        a, b, c, d = logits
        assert rel_err(d, a) <= FP32_TOL, step
        assert torch.isfinite(b).all() and rel_err(b, c) <= ROUNDED_WORST_TOL and rel_err(b, a) <= STAGE_TOL, step
        token = torch.tensor([int(a.argmax())])
        logits = [r.decode([kv], token)[0] for r, kv in zip(runners, kvs, strict=True)]
    return stage


@ggml_needed
def test_cpu_stage_with_a_q4_k_m_file_s_dense_types_and_a_long_prompt(q4_k_m_gguf):
    """Dense types as a Q4_K_M file has them (attn_v and the head Q6_K, the rest Q4_K), so q, k and
    v stay three matrices, and a prompt of more than DEQUANT_ROWS tokens (the dequantizing path):
    the stage against the reference as test_cpu_stage_agrees_with_the_reference holds it."""
    f = GGUFFile(q4_k_m_gguf)

    def q_k_v_apart(stage: Stage) -> None:
        layer = stage.model.w.layers[0]
        assert layer.wqkv is None and isinstance(layer.wv, BlockMatrix) and layer.wv.ggml_type == Q.Q6_K
        assert isinstance(layer.wq, BlockMatrix) and layer.wq.ggml_type == Q.Q4_K
        assert isinstance(stage.model.w.output, BlockMatrix) and stage.model.w.output.ggml_type == Q.Q6_K

    stage_against_the_reference(f, spec_from_gguf(f), DEQUANT_ROWS + 6, seed=11, check=q_k_v_apart)


@ggml_needed
def test_bench_reports_the_executor_s_rate(tiny_gguf, tmp_path):
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--devices", "cpu", "--threads", "1", "--prompt-tokens",
                                  "32", "--decode-tokens", "4", "--runs", "1", "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    (cpu,) = json.loads((tmp_path / "b.json").read_text())["cpu_experts"]
    assert cpu["executor"] == "ggml on 1 thread"
    rates = {x["rows"]: x for x in cpu["rates"]}
    spec = spec_from_gguf(GGUFFile(tiny_gguf))
    assert rates[1]["calls"] == spec.n_layers * (4 + 2)  # the timed steps and the two warm-up steps
    assert rates[32]["calls"] == spec.n_layers * 2  # the prompt, and its compute-only pass
    assert all(x["gb_per_s"] > 0 and x["ms_per_call"] > 0 for x in rates.values())
    assert "experts on the host's cores (ggml on 1 thread): batch 1 " in r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--devices", "cpu", "--threads", "0"])
    assert r.exit_code == 2 and "--threads" in r.output
