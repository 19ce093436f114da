"""GPU checks (marker `gpu`; skipped without CUDA): CUDA kernels against their torch twins, the
stage against the reference forward, the VRAM budget, and greedy decode GPU vs CPU."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from strata_mgpu.config import LayerSplit, StageSwitches
from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.ops import DecodeOps
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import Stage, StageOptions
from tests.test_peer_prefill import count_hand_overs
from tests.test_q8_dot import quantize_words

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
BF16_TOL = 2e-2  # max|diff| / max|ref| for bf16 compute against the fp32 reference
# the same for decode steps, whose gathered experts run the integer kernels (8-bit activations): on
# the H200, `scripts/bf16_err_probe.py` (12 prompts x 4 steps, small preset) max 0.0214, prompts 0.0146
BF16_Q8_TOL = 3e-2


def second_gpu() -> torch.device:
    """The second stage's card: cuda:1 on a two-GPU machine (the hand-over then crosses two real
    devices through mapped host memory), else a second stage on cuda:0."""
    return torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)


def stage_on_its_own_budget(f: GGUFFile, spec, budget_gib: float, **options) -> tuple[Stage, int]:
    """A CUDA stage whose plan fills `budget_gib`, built after earlier tests' stages are collected,
    and the bytes reserved before it (what they left: a stage still alive raises the device's cap)
    with the peak reset: the stage's own peak is `torch.cuda.max_memory_reserved() - base`."""
    import gc

    gc.collect()
    torch.cuda.init()  # run first (a test alone), the peak's reset needs the device's context
    base = torch.cuda.memory_reserved(CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    return build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=budget_gib, **options)), base


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


def test_gather_from_vram_and_mapped_host_equals_twin(kernels, tiny_gguf):
    """Decode's gather: experts read from cache slots and from the pinned arena in one launch."""
    assert kernels.host_pointers, "this GPU cannot read registered host memory at its host address"
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8))
    cache = stage.experts.cache
    cache_small = type(cache)(stage.ctx, stage.arena, range(spec.n_layers), n_slots=3 * spec.n_layers)
    lay = stage.arena.layouts[2]
    picks = torch.tensor([0, 7, 2, 5, 5, 1], device=CUDA)  # resident and not, one twice
    m, F, D = picks.numel(), spec.expert_ffn, spec.hidden
    outs = []
    for k in (kernels, TorchKernels()):
        gu = torch.full((m, 2 * F, D), float("nan"), dtype=torch.bfloat16, device=CUDA)
        dn = torch.full((m, D, F), float("nan"), dtype=torch.bfloat16, device=CUDA)
        k.gather_experts(cache_small, 2, picks, lay, gu, dn)
        outs.append((gu, dn))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# The fused decode kernels against their twin, for every type: tests/test_gpu_quant.py.


OPS_TOL = 1e-2  # max|diff| / max|ref|: bf16 results, one rounding step apart at most


@pytest.fixture(scope="module")
def ops():
    from strata_mgpu.kernels.decode_ops import CudaDecodeOps

    return CudaDecodeOps(CUDA)


def _fresh_generator() -> tuple[torch.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    return torch.Generator(device=CUDA).manual_seed(seed), seed


@pytest.mark.parametrize("rows,n", [(1, 2048), (3, 4096), (1, 64)])
def test_fused_norms_equal_twin(ops, rows, n):
    g, seed = _fresh_generator()
    x = torch.randn(rows, n, device=CUDA, generator=g).to(torch.bfloat16)
    y = torch.randn(rows, n, device=CUDA, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(n, device=CUDA, generator=g)).to(torch.bfloat16)
    assert rel_err(ops.rms_norm(x, w, 1e-6), DecodeOps().rms_norm(x, w, 1e-6)) <= OPS_TOL, f"seed {seed}"
    want_x, want = DecodeOps().add_rms_norm(x, y, w, 1e-6)
    got_x, got = ops.add_rms_norm(x.clone(), y, w, 1e-6)
    assert torch.equal(got_x, want_x) and rel_err(got, want) <= OPS_TOL, f"seed {seed}"


def _random_caches(spec, capacities, g, layers=2):
    from strata_mgpu.model.kv_cache import KVCache

    caches = []
    for cap in capacities:
        kv = KVCache(layers, spec.n_kv_heads, spec.head_dim, capacity=cap, max_length=cap, device=CUDA,
                     dtype=torch.bfloat16)
        kv.k.copy_(torch.randn(kv.k.shape, device=CUDA, generator=g))
        kv.v.copy_(torch.randn(kv.v.shape, device=CUDA, generator=g))
        caches.append(kv)
    return caches


@pytest.mark.parametrize("preset,rows,yarn", [("tiny", 1, False), ("30b-a3b", 1, False), ("30b-a3b", 3, False),
                                             ("30b-a3b", 3, True), ("tiny-hybrid", 3, False),
                                             ("35b-a3b-hybrid", 3, False)])
def test_fused_qk_norm_rope_kv_equals_twin(ops, preset, rows, yarn):
    """B rows, each written into its own cache at its own position (layer 1 of 2); the rotation is
    the twin's tables' (YaRN's frequencies and attention factor included; the hybrids rotate a part
    of each head: 16 of 64, 64 of 256)."""
    import dataclasses
    from types import SimpleNamespace

    from gguf.constants import RopeScalingType

    from strata_mgpu.model.ops import rope_cos_sin
    from strata_mgpu.model.spec import RopeScaling
    from strata_mgpu.model.synthetic import PRESETS

    spec = PRESETS[preset].spec(preset)
    if yarn:
        spec = dataclasses.replace(spec, rope_scaling=RopeScaling(RopeScalingType.YARN, 4.0, 256))
    g, seed = _fresh_generator()
    H, Hkv, Dh, cap = spec.n_heads, spec.n_kv_heads, spec.head_dim, 1024
    w = SimpleNamespace(q_norm=(1 + 0.1 * torch.randn(Dh, device=CUDA, generator=g)).to(torch.bfloat16),
                        k_norm=(1 + 0.1 * torch.randn(Dh, device=CUDA, generator=g)).to(torch.bfloat16))
    q, k, v = (torch.randn(rows, n * Dh, device=CUDA, generator=g).to(torch.bfloat16) for n in (H, Hkv, Hkv))
    positions = torch.randint(0, cap, (rows,), device=CUDA, generator=g)
    cos, sin = rope_cos_sin(positions, spec, torch.bfloat16)
    outs = []
    twins = ops.paths["qk_norm_rope_kv:twin"]
    for impl in (ops, DecodeOps()):
        kvs = _random_caches(spec, [cap] * rows, torch.Generator(device=CUDA).manual_seed(seed))
        outs.append((impl.qk_norm_rope_kv(spec, w, 1, q.clone(), k, v, positions, cos, sin, kvs), kvs))
    assert ops.paths["qk_norm_rope_kv:twin"] == twins  # the kernel ran
    (q_got, kvs_got), (q_want, kvs_want) = outs
    assert rel_err(q_got, q_want) <= OPS_TOL, f"seed {seed}"
    for got, want in zip(kvs_got, kvs_want, strict=True):
        assert rel_err(got.k, want.k) <= OPS_TOL and torch.equal(got.v, want.v), f"seed {seed}"
        assert int((got.k != want.k).any(dim=(2, 3)).sum()) <= 1  # one cell of one layer written


@pytest.mark.parametrize("preset,capacities", [("tiny", [256]), ("30b-a3b", [1024]),
                                               ("30b-a3b", [300, 4096, 64, 20000])])
def test_fused_attention_equals_twin(ops, preset, capacities):
    """Each row against its own cache up to its own position: across split boundaries, at position
    0, at a cache's last cell, and with a long cache's wider splits."""
    from strata_mgpu.model.synthetic import PRESETS

    _check_attention(ops, PRESETS[preset].spec(preset), capacities)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(24, 2, 64), (20, 1, 128), (32, 2, 256), (3, 3, 128)])
def test_fused_attention_of_any_group_and_head_dim_equals_twin(ops, heads, kv_heads, head_dim):
    """Groups past a block's 8 query heads (12 = 8 + 4, 20 = 8 + 8 + 4, 16 = 8 + 8), of one head,
    every head dim."""
    from types import SimpleNamespace

    spec = SimpleNamespace(n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim)
    _check_attention(ops, spec, [300, 4096, 64, 9000])


def _check_attention(ops, spec, capacities):
    from strata_mgpu.kernels.decode_ops import attention_split

    g, seed = _fresh_generator()
    kvs = _random_caches(spec, capacities, g)
    # a random position for the first row; then the first key of the second split, 0, the last cell
    edges = [None, attention_split(max(capacities)), 0, capacities[-1] - 1]
    positions = torch.tensor([int(torch.randint(0, cap, (1,), generator=g, device=CUDA)) if edge is None else edge
                              for cap, edge in zip(capacities, edges, strict=False)], device=CUDA)
    q = torch.randn(len(capacities), spec.n_heads, spec.head_dim, device=CUDA, generator=g).to(torch.bfloat16)
    before = ops.paths["attention:cuda"]
    got, want = ops.attention(1, q, positions, kvs), DecodeOps().attention(1, q, positions, kvs)
    assert ops.paths["attention:cuda"] == before + 1, ops.path_summary()
    assert rel_err(got, want) <= OPS_TOL, f"seed {seed}, positions {positions.tolist()}"


@pytest.mark.parametrize("rows,renorm", [(1, True), (5, False)])
def test_fused_route_equals_twin(ops, rows, renorm):
    g, seed = _fresh_generator()
    E, D, A = 128, 2048, 8
    h = torch.randn(rows, D, device=CUDA, generator=g).to(torch.bfloat16)
    router = torch.randn(E, D, device=CUDA, generator=g) / 16
    w_got, e_got = ops.route(h, router, A, renorm)
    w_want, e_want = DecodeOps().route(h, router, A, renorm)
    assert torch.equal(e_got, e_want), f"seed {seed}"  # both largest first
    assert torch.allclose(w_got, w_want, rtol=1e-4, atol=1e-6), f"seed {seed}"


@pytest.mark.parametrize("rows", [1, 5])
def test_fused_moe_input_equals_its_parts(ops, rows):
    """moe_input_rows against the CUDA ops it replaces: the residual sum and h bit for bit (blocks of
    add_rms_norm_rows' width: the same sums), the same experts and weights as route_rows, and h's
    quantization equal to the twin's; x itself is left as it was."""
    g, seed = _fresh_generator()
    E, D, A = 128, 2048, 8
    x = torch.randn(rows, D, device=CUDA, generator=g).to(torch.bfloat16)
    y = torch.randn(rows, D, device=CUDA, generator=g).to(torch.bfloat16)
    w = (torch.rand(D, device=CUDA, generator=g) + 0.5).to(torch.bfloat16)
    router = torch.randn(E, D, device=CUDA, generator=g) / 16
    x0 = x.clone()
    before = ops.paths["moe_input:cuda"]
    x_got, h_got, w_got, e_got, hq = ops.moe_input(x, y, w, 1e-6, router, A, True)
    assert ops.paths["moe_input:cuda"] == before + 1 and torch.equal(x, x0), f"seed {seed}"
    x_want, h_want = ops.add_rms_norm(x.clone(), y, w, 1e-6)
    w_want, e_want = ops.route(h_want, router, A, True)
    assert torch.equal(x_got, x_want) and torch.equal(h_got, h_want), f"seed {seed}"
    assert torch.equal(e_got, e_want) and torch.equal(w_got, w_want), f"seed {seed}"
    want, _, _ = quantize_words(h_want.cpu().reshape(-1))
    got = hq.cpu().numpy().view(np.uint32).reshape(-1, want.shape[1])
    assert np.array_equal(got[:, :11], want[:, :11]), f"seed {seed}"
    assert not ops.rows_done.any()  # every row's last block set its counter back


@pytest.mark.parametrize("rows", [1, 37, 1024])
def test_grouped_mlp_equals_torch_twin(kernels, rows):
    E, D, F = 16, 256, 128
    g = torch.Generator(device=CUDA).manual_seed(rows)
    x = torch.randn(rows, D, device=CUDA, dtype=torch.bfloat16, generator=g)
    w_gu = torch.randn(E, 2 * F, D, device=CUDA, dtype=torch.bfloat16, generator=g) / 16
    w_d = torch.randn(E, D, F, device=CUDA, dtype=torch.bfloat16, generator=g) / 16
    counts = torch.bincount(torch.randint(0, E, (rows,), device=CUDA, generator=g), minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    got = kernels.grouped_mlp(x, offs, w_gu, w_d)
    want = TorchKernels().grouped_mlp(x.float(), offs, w_gu.float(), w_d.float())
    assert rel_err(got, want) <= BF16_TOL


@pytest.fixture(scope="module", params=["tiny", "small"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / f"{request.param}.gguf"
    write_model(path, request.param, seed=3)
    f = GGUFFile(path)
    return f, spec_from_gguf(f)


def _share_routing(stage, ref) -> None:
    """From now on the reference picks, in each layer, the experts the stage just picked there
    (weights from its own router over them): only arithmetic differences remain to bound. `ref`
    may be another stage, on any device."""
    picked: dict[int, torch.Tensor] = {}
    stage_route = stage.model.route

    def recording(i, h, router):
        weights, experts = stage_route(i, h, router)
        picked[i] = experts.cpu()
        return weights, experts

    def forced(i, h, router):
        experts = picked[i].to(h.device)
        probs = torch.softmax(h.float() @ router.float().T, dim=-1)
        weights = probs.gather(1, experts)
        return weights / weights.sum(-1, keepdim=True), experts

    stage.model.routing, ref.model.routing = recording, forced


def test_stage_bf16_matches_reference_on_shared_routing(model):
    """bf16 compute against the fp32 reference, with the reference made to pick the experts the
    bf16 stage picked. Top-k routing is discontinuous: where two router scores lie within bf16
    rounding, bf16 takes the other expert, that row moves by O(1), and attention carries it on to
    later rows (seen on the small preset: median row error 7e-2 with free routing, on the CPU's
    bf16 twins as much as on the GPU). Sharing the routing leaves only bf16 arithmetic to bound;
    fp32 compute with free routing (next test) must agree everywhere."""
    f, spec = model
    ref = load_reference_runner(f, spec)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8,
                                              switches=StageSwitches(cuda_graphs=False)))  # the hooks sync
    _share_routing(stage, ref)
    # a prompt of whole layers (bf16 GEMMs): a shorter one gathers through the integer kernels,
    # whose 8-bit activations add their own rounding (held to their twin in test_gpu_quant)
    n = stage.experts.gather_picks // spec.n_experts_used + 8
    # one of the prompts scripts/bf16_err_probe.py measured (the tolerances are set from them)
    prompt = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    kv_r, kv_s = ref.new_sequence(n + 44), stage.new_sequence(n + 44)
    b = stage.model.logits(stage.model.forward(prompt.to(CUDA), [_seg(kv_s, n)]))
    a = ref.model.logits(ref.model.forward(prompt, [_seg(kv_r, n)]))
    assert rel_err(b.cpu(), a) <= BF16_TOL
    for _ in range(4):  # decode: experts gathered from VRAM slots and the mapped arena (integer kernels)
        token = torch.tensor([int(a[-1].argmax())])
        b = stage.decode([kv_s], token)
        a = ref.decode([kv_r], token)
        assert rel_err(b.cpu(), a) <= BF16_Q8_TOL


def test_short_prompts_gather_where_every_expert_is_resident(model):
    """All experts resident: a 40-token prompt (fewer picks than GATHER_PICKS_RESIDENT) runs the
    fused gather kernels, not a whole-layer pass, and matches the reference on shared routing."""
    from strata_mgpu.stage.experts.streamed import GATHER_PICKS_RESIDENT

    f, spec = model
    ref = load_reference_runner(f, spec)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8, switches=StageSwitches(cuda_graphs=False)))
    experts = stage.experts
    assert experts.cache.per_layer == spec.n_experts and experts.gather_picks == GATHER_PICKS_RESIDENT
    _share_routing(stage, ref)
    prompt = torch.randint(0, spec.vocab_size, (40,))
    before = stage.kernels.paths["moe_gathered:fused"]
    b = stage.model.logits(stage.model.forward(prompt.to(CUDA), [_seg(stage.new_sequence(64), 40)]))
    assert stage.kernels.paths["moe_gathered:fused"] == before + spec.n_layers and not experts.streaming
    a = ref.model.logits(ref.model.forward(prompt, [_seg(ref.new_sequence(64), 40)]))
    assert rel_err(b.cpu(), a) <= BF16_TOL


def test_short_forwards_through_the_fused_ops_equal_runs_path(model):
    """Decoder.static_rows on a CUDA stage: a prompt, a chunk after a prefix and a short prompt
    packed beside it take the row path, several rows to one cache (CudaDecodeOps'
    qk_norm_rope_kv and attention reading each row's cache up to its own position). Every row's
    logits against run's path on the same stage, the static path made to take run's picks (bf16
    routing flips would move rows by O(1); see the test above)."""
    from strata_mgpu.model.decoder import Segment

    f, spec = model
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8, switches=StageSwitches(cuda_graphs=False)))
    dec = stage.model
    assert dec.static_rows and not dec.experts.should_stream(40)
    own, picked = dec.route, {}

    def recording(i, h, router):
        weights, experts = own(i, h, router)
        picked[i] = experts
        return weights, experts

    def forced(i, h, router):
        probs = torch.softmax(h.float() @ router.float().T, dim=-1)
        weights = probs.gather(1, picked[i])
        return weights / weights.sum(-1, keepdim=True), picked[i]

    def both(chunks, caches_run, caches_static):
        ends = [sum(c.shape[0] for c in chunks[:k + 1]) for k in range(len(chunks))]
        tokens = torch.cat(chunks).to(CUDA)
        out = []
        for static, caches, route in ((False, caches_run, recording), (True, caches_static, forced)):
            dec.static_rows, dec.routing = static, route
            segments = [Segment(e - c.shape[0], e, kv) for c, e, kv in zip(chunks, ends, caches, strict=True)]
            attention = stage.kernels.paths["attention:cuda"]
            out.append(dec.logits(dec.forward(tokens, segments)).float().cpu())
            assert stage.kernels.paths["attention:cuda"] - attention == (spec.n_layers if static else 0)
        return out

    dec.routing = recording
    try:
        g = torch.Generator().manual_seed(5)
        prompt = torch.randint(0, spec.vocab_size, (40,), generator=g)
        other = torch.randint(0, spec.vocab_size, (9,), generator=g)
        kv_a, kv_b = stage.new_sequence(64), stage.new_sequence(64)
        # both paths' projections of so few rows take 8-bit inputs (dense_q8), where the paths' bf16
        # differences in a projection's input may move a value across a rounding step: BF16_TOL
        # was passed (docs/BENCHMARKS.md, fourteenth session)
        a, b = both([prompt[:25]], [kv_a], [kv_b])  # from empty caches
        assert rel_err(b, a) <= BF16_Q8_TOL
        # the same prefix in both caches (each path's own bf16 roundings of it compound with the
        # chunk's: 2.1e-2 in one H200 run), so only the chunk's arithmetic differs
        kv_b.k.copy_(kv_a.k)
        kv_b.v.copy_(kv_a.v)
        a, b = both([prompt[25:], other], [kv_a, stage.new_sequence(64)], [kv_b, stage.new_sequence(64)])
        assert rel_err(b, a) <= BF16_Q8_TOL  # a chunk after a prefix, one packed beside
    finally:
        dec.routing = None
        dec.static_rows = True


def test_stage_fp32_agrees_on_top1_everywhere(model):
    """fp32 on the card against the fp32 reference on the CPU, routing free: they differ by
    summation order alone, unless a router score pair lies within that difference and a pick
    flips, which moves that row and, through attention, the later ones by O(1). The prompt is
    seeded: drawn from the global generator it depended on what the tests before it had drawn,
    and one such draw in a full GPU run (of about 25 tried) hit a flip (rel err 0.107; the 24
    seeded prompts tried on the H200 stayed at 1.0e-6 to 1.4e-6, before and after the house
    change alike)."""
    f, spec = model
    ref = load_reference_runner(f, spec)
    stage = build_stage(f, spec, StageOptions(device=CUDA, dtype=torch.float32))
    prompt = torch.randint(0, spec.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
    a = ref.model.logits(ref.model.forward(prompt, [_seg(ref.new_sequence(300), 256)]))
    b = stage.model.logits(stage.model.forward(prompt.to(CUDA), [_seg(stage.new_sequence(300), 256)])).cpu()
    assert rel_err(b, a) <= 1e-3  # tf32-free fp32: summation order only
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_max_vram_is_never_exceeded(model):
    f, spec = model
    budget = 1.0
    stage, base = stage_on_its_own_budget(f, spec, budget, chunk_size=1024, kv_tokens=2048)
    kv = stage.new_sequence(1100)
    stage.prefill(kv, torch.randint(0, spec.vocab_size, (1024,)))
    for _ in range(8):
        stage.decode([kv], torch.tensor([1]))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_reserved(CUDA) - base <= budget * 2**30


def test_server_shaped_decode_within_a_tight_budget(model):
    """Eight sampled requests decoded together as the server runs them (graphs captured at the
    engine's start, one per batch size where experts are only partly resident), on a stage whose
    budget its plan fills: every request finishes, none with an out-of-memory error, and the card
    holds no more than the budget. (On the H200 at --max-vram 16 the 30B-A3B run failed this way:
    a graph capture ran out of memory, then a request ended with an error.)"""
    from strata_mgpu.model.tokenizer import tokenizer_from_gguf
    from strata_mgpu.tools.server_decode import measure_server_decode

    f, spec = model
    budget = 1.0
    stage, base = stage_on_its_own_budget(f, spec, budget, chunk_size=1024, kv_tokens=2048)
    report = measure_server_decode(stage, tokenizer_from_gguf(f), 8, 64)  # raises if a request fails
    assert report.n_requests == 8 and report.n_generated == 8 * 64
    assert torch.cuda.max_memory_reserved(CUDA) - base <= budget * 2**30


def test_graph_replay_equals_the_static_step_run_eagerly(tiny_gguf):
    """The captured graph replays the static step's own kernels: the same logits as running
    `step_static` eagerly on a twin cache. (Against the other decode path, `run`, bf16 results
    differ by rounding, and on the tiny model a rounding can flip a near-tied expert pick, which
    moves the logits by O(1): on the CPU, 2e-3 relative noise in attention moved bf16 logits by
    more than 2e-2 in 3 of 120 decode steps. The fused ops are checked against their twins above,
    the decode path against the CPU below.)"""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8))
    assert stage.graphs.enabled
    prompt = torch.randint(0, spec.vocab_size, (40,))
    kv_g, kv_e = stage.new_sequence(300), stage.new_sequence(300)
    a = stage.prefill(kv_g, prompt)
    stage.prefill(kv_e, prompt)
    graphs = set()
    for _ in range(6):
        token = torch.tensor([int(a.argmax())])
        a = stage.decode([kv_g], token)[0]  # graph replay
        with torch.inference_mode(), stage.ctx.on_compute():
            kv_e.reserve(1)
            position = torch.full((1,), kv_e.length, dtype=torch.long, device=CUDA)
            b = stage.model.step_static(token.to(CUDA), position, [kv_e])[0]
            kv_e.advance(1)
        graphs.add(id(stage.graphs.captured[1]))
        assert rel_err(a, b) <= 1e-3
        assert float(b[a.argmax()]) >= float(b.max()) - 1e-3 * float(b.abs().max())  # same top, or a tie
    assert len(graphs) == 1 and kv_g.length == kv_e.length == 46


def test_batched_graph_replay_equals_the_static_step_run_eagerly(tmp_path):
    """Three sequences of different lengths decode as one captured step of a 4-row bucket (each row
    its own cache and position, the fourth a pad row); one sequence leaving and another joining
    replays the same capture (the caches' table and positions are rewritten, not recaptured); two
    rows take the 2-row bucket's capture. Every step equals the same static step run eagerly on
    twin caches. (The small preset: 4 rows of the tiny one's would pick all its 8 experts, a
    batch that streams whole layers and decodes eagerly.)"""
    write_model(tmp_path / "small.gguf", "small", seed=5)
    f = GGUFFile(tmp_path / "small.gguf")
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8,
                                              switches=StageSwitches(decode_graph_batch=4)))
    lengths = (40, 9, 23, 15)
    kv_g = [stage.new_sequence(300) for _ in lengths]
    kv_e = [stage.new_sequence(300) for _ in lengths]
    tokens = []
    for n, g, e in zip(lengths, kv_g, kv_e, strict=True):
        prompt = torch.randint(0, spec.vocab_size, (n,))
        tokens.append(int(stage.prefill(g, prompt).argmax()))
        stage.prefill(e, prompt)
    rows = [0, 1, 2]
    captures = []
    pad_kv = stage.model.new_cache(1, capacity=1)
    for step in range(8):
        if step == 3:  # the second sequence leaves, the fourth joins: same bucket, same capture
            rows = [0, 2, 3]
        if step == 6:  # two rows: the 2-row bucket
            rows = [0, 3]
        g, e = [kv_g[r] for r in rows], [kv_e[r] for r in rows]
        a = stage.decode(g, torch.tensor([tokens[r] for r in rows]))  # graph replay [B, V]
        captures.append(id(stage.graphs.captured[4 if len(rows) == 3 else 2]))
        with torch.inference_mode(), stage.ctx.on_compute():
            for kv in e:
                kv.reserve(1)
            pad = 4 - len(rows) if len(rows) == 3 else 0  # the same GEMM shapes as the replay's
            positions = torch.tensor([kv.length for kv in e] + [0] * pad, device=CUDA)
            inp = torch.tensor([tokens[r] for r in rows] + [0] * pad, device=CUDA)
            b = stage.model.step_static(inp, positions, e + [pad_kv] * pad)[:len(rows)]
            for kv in e:
                kv.advance(1)
        assert a.shape == b.shape == (len(rows), spec.vocab_size)
        assert rel_err(a, b) <= 1e-3, f"step {step}"
        for r, t in zip(rows, a.argmax(-1).tolist(), strict=True):
            tokens[r] = t
    assert len(set(captures[:6])) == 1 and len(set(captures)) == 2
    assert [kv.length for kv in kv_g] == [kv.length for kv in kv_e] == [48, 12, 29, 20]


def test_graphs_captured_ahead_serve_the_first_batches(tmp_path):
    """`warm_decode_graphs` captures every bucket before any request; a batch of three then replays
    the 4-row capture made ahead (no new capture) and equals the same static step run eagerly."""
    write_model(tmp_path / "small.gguf", "small", seed=6)
    f = GGUFFile(tmp_path / "small.gguf")
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8,
                                              switches=StageSwitches(decode_graph_batch=4)))
    assert stage.warm_decode_graphs(300) == [1, 2, 4]
    ahead = {b: id(g) for b, g in stage.graphs.captured.items()}
    kv_g = [stage.new_sequence(300) for _ in range(3)]
    kv_e = [stage.new_sequence(300) for _ in range(3)]
    tokens = []
    for n, g, e in zip((40, 9, 23), kv_g, kv_e, strict=True):
        prompt = torch.randint(0, spec.vocab_size, (n,))
        tokens.append(int(stage.prefill(g, prompt).argmax()))
        stage.prefill(e, prompt)
    pad_kv = stage.model.new_cache(1, capacity=1)
    for _ in range(3):
        a = stage.decode(kv_g, torch.tensor(tokens))
        with torch.inference_mode(), stage.ctx.on_compute():
            for kv in kv_e:
                kv.reserve(1)
            positions = torch.tensor([kv.length for kv in kv_e] + [0], device=CUDA)
            b = stage.model.step_static(torch.tensor(tokens + [0], device=CUDA), positions, kv_e + [pad_kv])[:3]
            for kv in kv_e:
                kv.advance(1)
        assert rel_err(a, b) <= 1e-3
        tokens = a.argmax(-1).tolist()
    assert {b: id(g) for b, g in stage.graphs.captured.items()} == ahead


def test_split_graph_replays_equal_the_static_steps_run_eagerly(tiny_gguf):
    """Each stage of a split captures its own layers (token -> hidden, hidden -> logits) and the
    hand-over runs between the replays: a decode step equals the stages' static steps run eagerly
    one after the other on twin caches."""
    from strata_mgpu.split.runner import build_split

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    opts = StageOptions(device=CUDA, max_vram_gib=4)
    split = build_split(f, spec, [opts, replace(opts, device=second_gpu())], LayerSplit((2,)))
    assert all(s.graphs.enabled for s in split.stages)
    prompt = torch.randint(0, spec.vocab_size, (40,))
    kv_g, kv_e = split.new_sequence(300), split.new_sequence(300)
    a = split.prefill(kv_g, prompt)
    split.prefill(kv_e, prompt)
    for _ in range(6):
        token = torch.tensor([int(a.argmax())])
        a = split.decode([kv_g], token)[0]  # two replays, the hand-over between them
        x = token
        with torch.inference_mode():
            for k, stage in enumerate(split.stages):
                part = kv_e.parts[k]
                with stage.ctx.on_compute():
                    part.reserve(1)
                    position = torch.full((1,), part.length, dtype=torch.long, device=stage.ctx.device)
                    x = stage.model.step_static(x.to(stage.ctx.device), position, [part])
                    part.advance(1)
        b = x[0].to(a.device)
        assert rel_err(a, b) <= 1e-3
    assert all(s.graphs.captured for s in split.stages) and kv_g.length == kv_e.length == 46


def test_greedy_decode_gpu_equals_cpu(tiny_gguf):
    from strata_mgpu.config import EngineConfig
    from strata_mgpu.engine.engine import Engine
    from strata_mgpu.engine.sampler import SamplingParams
    from strata_mgpu.model.tokenizer import tokenizer_from_gguf
    from tests.test_engine import run_all

    f = GGUFFile(tiny_gguf)
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}]))
    outs = []
    fp32 = StageOptions(device=CUDA, dtype=torch.float32)
    for runner in (load_reference_runner(f, spec), build_stage(f, spec, fp32)):
        (out,) = run_all(Engine(runner, tok, EngineConfig()), [(prompt, params)])
        outs.append([t for o in out for t in o.token_ids])
    assert outs[0] == outs[1]


# where two greedy runs of different numerics part, the CPU's logprobs of the two choices differ by
# less than this (nats): a near tie. The GPU's 8-bit activations (Q8_0 blocks of 32) and ggml's on
# the CPU (Q8_K blocks of 256) round differently, so a random model's near ties may fall either way.
NEAR_TIE = 0.5


def test_greedy_through_the_server_gpu_equals_cpu_up_to_a_near_tie(tiny_gguf, tmp_path):
    """The same greedy tokens through the server on the GPU as on the CPU, up to where the two part,
    if they do: there the CPU ranks the GPU's token among its top 5, within NEAR_TIE of its own."""
    import httpx

    from tests.server_proc import running_server

    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 5}
    runs = []
    for device, dtype in (("cpu", "bf16"), ("cuda:0", "fp32")):
        args = [str(tiny_gguf), "--devices", device, "--dtype", dtype]
        with running_server(args, tmp_path / f"{device}.log") as base:
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            runs.append(r.json()["choices"][0]["logprobs"]["content"])
    cpu, gpu = runs
    assert len(cpu) == len(gpu) == 24
    parted = next((i for i, (a, b) in enumerate(zip(cpu, gpu, strict=True)) if a["token"] != b["token"]), None)
    if parted is not None:
        tops = {t["token"]: t["logprob"] for t in cpu[parted]["top_logprobs"]}
        assert gpu[parted]["token"] in tops, (parted, cpu[parted], gpu[parted]["token"])
        assert cpu[parted]["logprob"] - tops[gpu[parted]["token"]] < NEAR_TIE, (parted, cpu[parted])


def _seg(kv, n):
    from strata_mgpu.model.decoder import Segment

    return Segment(0, n, kv)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_two_stages_equal_one_stage(tiny_gguf, graphs):
    """The hand-over through mapped host memory (copy_f32_wide both ways), two stages with their
    own streams (on two cards where there are two): bit-identical to one stage, prefill in chunks
    and decode; with graphs, each stage replays its own capture and the one stage its whole one."""
    from strata_mgpu.split.runner import build_split

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    opts = StageOptions(device=CUDA, max_vram_gib=4, chunk_size=64, switches=StageSwitches(cuda_graphs=graphs))
    single = build_stage(f, spec, opts)
    split = build_split(f, spec, [opts, replace(opts, device=second_gpu())], LayerSplit((2,)))
    assert all(s.kernels.host_pointers for s in split.stages)
    prompt = torch.randint(0, spec.vocab_size, (200,))
    a_kv, b_kv = single.new_sequence(300), split.new_sequence(300)
    for start in range(0, 200, 64):
        a = single.prefill(a_kv, prompt[start:start + 64])
        b = split.prefill(b_kv, prompt[start:start + 64])
    assert torch.equal(a.cpu(), b.cpu())
    for _ in range(4):
        token = torch.tensor([int(a.argmax())])
        a, b = single.decode([a_kv], token)[0], split.decode([b_kv], token)[0]
        assert torch.equal(a.cpu(), b.cpu())
    assert all(bool(s.graphs.captured) == graphs for s in [single, *split.stages])


def _routing_recorded_then_forced(runner):
    """Each stage's routing recorded per layer on the next prompt; calling the returned function
    makes every later prompt take those picks (weights from the stage's router over them), a
    layer's rows in the order they come (all at once, or two halves). Then helped and help-off
    differ only by arithmetic: a bf16 near-tie cannot flip a pick and move the later layers."""
    picked: dict[tuple[int, int], torch.Tensor] = {}
    taken: dict[tuple[int, int], int] = {}
    for k, stage in enumerate(runner.stages):
        def recording(i, h, router, k=k, own=stage.model.route):
            weights, experts = own(i, h, router)
            picked[(k, i)] = experts
            return weights, experts
        stage.model.routing = recording

    def force() -> None:
        for k, stage in enumerate(runner.stages):
            def forced(i, h, router, k=k):
                at = taken.get((k, i), 0)
                experts = picked[(k, i)][at:at + h.shape[0]]
                taken[(k, i)] = (at + h.shape[0]) % picked[(k, i)].shape[0]
                weights = torch.softmax(h.float() @ router.float().T, dim=-1).gather(1, experts)
                return weights / weights.sum(-1, keepdim=True), experts
            stage.model.routing = forced
    return force


@pytest.mark.parametrize("halves", [False, True], ids=["rows", "halves"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_helper_on_two_stages(tiny_gguf, dtype, halves):
    """PeerPrefill with the hand-overs through mapped memory, all rows at once or in two halves:
    repeatable run after run, and equal to help-off up to the rounding of the two partial sums:
    fp32 within 1e-5; bf16 within BF16_TOL on shared routing (the picks of a help-off prompt)."""
    from strata_mgpu.split.help_rule import HelpPolicy
    from strata_mgpu.split.runner import build_split

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    # the tiny model fits whole: keep most experts streamed
    opts = StageOptions(device=CUDA, max_vram_gib=4, chunk_size=512, dtype=dtype,
                        switches=StageSwitches(cuda_graphs=False, resident_experts=2))
    runner = build_split(f, spec, [opts, replace(opts, device=second_gpu())], LayerSplit((2,)),
                         help_policy=HelpPolicy())
    for helper in runner.helpers:
        helper.halves_from = 1 if halves else 0
    prompt = torch.randint(0, spec.vocab_size, (300,))
    if dtype == torch.bfloat16:  # a help-off prompt's picks, then every prompt on them
        runner.policy = HelpPolicy(enabled=False)
        force = _routing_recorded_then_forced(runner)
        runner.prefill(runner.new_sequence(400), prompt, whole_prompt=True)
        force()
    firsts = count_hand_overs(runner)
    outs = []
    for policy in (HelpPolicy(enabled=False), HelpPolicy(fixed_share=0.4), HelpPolicy(fixed_share=0.4)):
        runner.policy = policy
        outs.append(runner.prefill(runner.new_sequence(400), prompt, whole_prompt=True).cpu())
    off, on, again = outs
    assert torch.equal(on, again)
    assert rel_err(on, off) <= (1e-5 if dtype == torch.float32 else BF16_TOL)
    assert all(h.to_helper.bytes_moved > 0 for h in runner.helpers)
    assert firsts == ([True, False] if halves else [True]) * (2 * spec.n_layers)  # two helped prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resident_experts_in_place_equal_all_streamed(tiny_gguf, dtype):
    """A prompt pass computes resident experts from their VRAM slots (dequantized through the
    address table) and streams only the rest: the same logits as streaming everything. The
    dequant is bit-exact whatever the source; only the grouped GEMM sees its rows in another order."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    # long enough to pass whole layers at every k: with all resident a shorter prompt gathers through
    # the integer kernels instead (other roundings, and on the tiny model a near-tied pick flips)
    from strata_mgpu.stage.experts.streamed import GATHER_PICKS_RESIDENT

    prompt = torch.randint(0, spec.vocab_size, (GATHER_PICKS_RESIDENT // spec.n_experts_used + 8,))
    outs = {}
    for k in (0, 3, spec.n_experts):
        stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=4, dtype=dtype,
                                                  switches=StageSwitches(resident_experts=k, cuda_graphs=False)))
        assert stage.experts.should_stream(prompt.numel())
        outs[k] = stage.prefill(stage.new_sequence(prompt.numel() + 100), prompt).cpu()
        experts = stage.experts
        assert (experts.ring.uploaded_bytes if experts.ring else 0) == experts.pass_bytes()
        assert experts.pass_bytes() == stage.arena.nbytes * (spec.n_experts - k) // spec.n_experts
    for k, out in outs.items():
        assert rel_err(out, outs[0]) <= (1e-5 if dtype == torch.float32 else BF16_TOL), k


def test_plan_holds_under_the_budget_at_a_long_prompt(tiny_gguf):
    """The VRAM plan's lines hold what a prompt of the planned length really allocates: what the
    stage allocates, at its peak, stays within the plan's total (other tests' leftovers aside)."""
    import gc

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    # the cap is per process: the stage gets 1 GiB on top of what earlier tests left reserved
    budget = 1 + torch.cuda.memory_reserved(CUDA) / 2**30
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=budget, chunk_size=2048, kv_tokens=4096))
    kv = stage.new_sequence(4096)
    prompt = torch.randint(0, spec.vocab_size, (4000,))
    for start in range(0, 4000, 2048):
        stage.prefill(kv, prompt[start:start + 2048])
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated(CUDA) - before <= stage.plan.total, stage.plan.describe()
