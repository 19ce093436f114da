"""The q8_0 KV cache (`--cache-type-k/-v q8_0`, `model.kv_cache.KVFormat`): quantization held to
ggml's C byte for byte; the tiny model's forward with q8_0 KV against plain fp32 KV within the
measured tolerance below; the two-tier cache's spills and the prefix cache's blocks moving its
bytes exactly; the options; the memory plan's bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.cli import main
from strata_mgpu.config import Placement, StageSwitches
from strata_mgpu.engine.build import stage_options
from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_cache import KVCache, KVFormat
from strata_mgpu.model.kv_pool import BlockTable
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import PRESETS
from strata_mgpu.model.weights import load_weights
from strata_mgpu.quant import dequantize_rows
from strata_mgpu.quant.quantize import quantize_q8_0
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.kv.two_tier import KVStaging, TwoTierKV, make_kv_cache, staging_bytes, window_bytes
from strata_mgpu.stage.memory_plan import GiB, kv_bytes, plan_memory
from strata_mgpu.stage.stage import StageOptions

Q8 = (Q.Q8_0, Q.Q8_0)
MIXED = [(Q.Q8_0, Q.Q8_0), (Q.Q8_0, Q.BF16), (Q.BF16, Q.Q8_0)]
# Measured on the tiny preset's fp32 reference (random weights), 16 random 48-token prompts (seed 1)
# and 32 greedy steps each, q8_0 keys and values against fp32 KV, over the prompt logits and every
# step fed the same tokens: logits' max |diff| / max |ref| a step has median 0.0053, 90th percentile
# 0.017, worst 0.36; 11 of 16 sequences' 32 tokens all equal. The worst cases are routing flips (8
# experts, random router): the same KV with 0.4% Gaussian noise instead (q8_0's relative step)
# gives the same worst case, 0.30. Bounds with room:
Q8_MEDIAN_TOL, Q8_P90_TOL, Q8_SAME_SEQUENCES = 0.01, 0.03, 10


def ggml_quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's own C (ggml_quantize_chunk -> quantize_row_q8_0_ref) of rows x [R, N] fp32: [R, N/32*34]."""
    ggml = pytest.importorskip("ggml", reason="ggml-python (the dev extra) is not installed")
    src = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = src.shape
    out = np.zeros(rows * n // 32 * 34, dtype=np.uint8)
    ggml.ggml_quantize_chunk(int(Q.Q8_0), src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                             out.ctypes.data_as(ctypes.c_void_p), 0, rows, n, None)
    return out.reshape(rows, -1)


def edge_rows(g: torch.Generator) -> torch.Tensor:
    """Rows [R, 64] ggml must agree with us on: random spreads, exact ties of x / d at .5, all
    zeros, one nonzero value, tiny (subnormal d) and huge values."""
    rows = [torch.randn(64, generator=g) * s for s in (1e-3, 1.0, 30.0, 1e4)]
    tie = torch.arange(-32, 32, dtype=torch.float32) + 0.5  # q = x * 127 / 31.5: some products land on .5
    rows += [tie, torch.zeros(64), torch.zeros(64).index_fill_(0, torch.tensor([5]), -2.0), tie * 1e-6,
             torch.full((64,), 3.0), torch.randn(64, generator=g) * 1e-7]
    return torch.stack(rows)


def test_quantize_q8_0_equals_ggml_byte_for_byte():
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    x = torch.cat([edge_rows(g), torch.randn(500, 64, generator=g) * torch.rand(500, 1, generator=g) * 10])
    got, want = quantize_q8_0(x).numpy(), ggml_quantize_q8_0(x.numpy())
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, f"{bad.size} rows differ; first {bad[0]}: x {x[bad[0]].tolist()[:8]}..."
    # and back: dequant.py's Q8_0 (held to ggml's to_float in tests/test_quant_iq.py) within half a step
    # d, plus what d's rounding to fp16 costs (127 |d - fp16(d)| <= 127 * 2^-11 d), where d is a normal fp16
    back = dequantize_rows(torch.from_numpy(got).reshape(-1, 34), Q.Q8_0, 32).reshape(-1, 32)
    d = x.reshape(-1, 32).abs().amax(-1, keepdim=True) / 127
    normal = d[:, 0] > 2**-14
    assert ((back - x.reshape(-1, 32)).abs() <= (0.5 + 127 * 2**-11) * d)[normal].all()


@pytest.mark.parametrize("types", MIXED)
def test_a_q8_cache_stores_blocks_and_returns_them_dequantized(types):
    f = KVFormat(torch.float32, *types)
    kv = KVCache(2, 2, 64, capacity=8, max_length=16, keys=types[0], values=types[1])
    assert kv.k.shape[-1] == f.row(types[0], 64) and kv.v.shape[-1] == f.row(types[1], 64)
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    kv.reserve(12)  # grows past the 8 cells: the stored rows move as they are
    k_all, v_all = kv.write(1, k, v)
    assert k_all.dtype == v_all.dtype == torch.float32 and k_all.shape == (5, 2, 64)
    for t, x, got in ((types[0], k, k_all), (types[1], v, v_all)):
        want = x if t == Q.BF16 else dequantize_rows(quantize_q8_0(x).reshape(-1, 34), Q.Q8_0, 32).view(x.shape)
        assert torch.equal(got, want)
    assert not kv.k[:, 5:].any() and not kv.k[0].any()  # unwritten cells stay zeros (d = 0, q = 0)
    assert kv.nbytes == 2 * 16 * 2 * sum(f.row(t, 64) * f.storage(t).itemsize for t in types)


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    return f, spec, load_weights(f, spec)


def greedy(model: ReferenceModel, prompt: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """The prompt's logits, then `steps` greedy decode steps' logits and tokens."""
    kv = model.new_cache(max_length=prompt.shape[0] + steps)
    logits = [model.logits(model.forward(prompt, [Segment(0, prompt.shape[0], kv)]))]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(model.logits(model.forward(torch.tensor(tokens[-1:]), [Segment(0, 1, kv)])))
    return logits, tokens


@torch.no_grad()
def test_q8_kv_forward_is_within_the_measured_tolerance_of_fp32_kv(tiny):
    _, spec, weights = tiny
    plain, q8 = ReferenceModel(spec, weights), ReferenceModel(spec, weights, kv_types=Q8)
    g = torch.Generator().manual_seed(1)
    errs, same = [], 0
    for _ in range(16):
        prompt = torch.randint(0, spec.vocab_size, (48,), generator=g)
        (want, want_tokens), (got, got_tokens) = greedy(plain, prompt, 32), greedy(q8, prompt, 32)
        n = next((i for i, (a, b) in enumerate(zip(want_tokens, got_tokens, strict=True)) if a != b), 32)
        same += n == 32
        errs += [float((a - b).abs().max() / a.abs().max()) for a, b in zip(want[:n + 1], got[:n + 1], strict=True)]
    median, p90 = np.median(errs), np.percentile(errs, 90)
    assert median <= Q8_MEDIAN_TOL and p90 <= Q8_P90_TOL and same >= Q8_SAME_SEQUENCES, (median, p90, same)


def cpu_staging(spec, types, max_cells: int, prefetch: bool) -> KVStaging:
    return KVStaging.for_model(spec, max_cells, ctx=DeviceContext(torch.device("cpu")), dtype=torch.float32,
                               prefetch=prefetch, kv_types=types)


@torch.no_grad()
@pytest.mark.parametrize("types", MIXED)
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_two_tier_q8_with_spills_equals_a_q8_cache_in_vram(tiny, types, prefetch):
    """Spilled cells go to host RAM and back as stored bytes: every logit equals the all-VRAM q8
    cache's, bit for bit."""
    _, spec, weights = tiny
    model = ReferenceModel(spec, weights, kv_types=types)
    layers = range(spec.n_layers)
    plain = make_kv_cache(spec, layers, 96, 96, device=torch.device("cpu"), dtype=torch.float32, staging=None,
                          kv_types=types)
    two = make_kv_cache(spec, layers, 16, 96, device=torch.device("cpu"), dtype=torch.float32,
                        staging=cpu_staging(spec, types, 96, prefetch), kv_types=types)
    assert isinstance(two, TwoTierKV) and isinstance(plain, KVCache)
    prompt = torch.randint(0, spec.vocab_size, (60,), generator=torch.Generator().manual_seed(5))
    at = 0
    for n in (10, 30, 1, 19):
        want, got = (model.logits(model.forward(prompt[at:at + n], [Segment(0, n, kv)])) for kv in (plain, two))
        assert torch.equal(got, want), f"chunk {at}..{at + n}"
        at += n
    for _ in range(4):
        token = want[-1].argmax()[None]
        want, got = (model.logits(model.forward(token, [Segment(0, 1, kv)])) for kv in (plain, two))
        assert torch.equal(got, want)
    assert two.spilled and two.host_k is not None and two.host_k.dtype == plain.k.dtype
    assert torch.equal(two.host_k[:, :40], plain.k[:, :40]) and torch.equal(two.host_v[:, :40], plain.v[:, :40])
    assert two.nbytes == window_bytes(spec, spec.n_layers, 16, elem=4, kv_types=types)
    assert two.staging.nbytes == staging_bytes(spec, 96, prefetch, elem=4, kv_types=types)


@pytest.mark.parametrize("kind", ["reference", "stage"])
def test_a_prefix_restored_from_q8_blocks_continues_bit_for_bit(tiny, kind):
    """A continuation on q8_0 blocks of another sequence, half of them moved through the host tier and
    back byte for byte: its rows, the continuation and 16 greedy steps equal the sequence that
    computed the prefix itself."""
    f, spec, _ = tiny
    runner = (load_reference_runner(f, spec, kv_types=Q8) if kind == "reference" else
              build_stage(f, spec, StageOptions(device=torch.device("cpu"), chunk_size=256,
                                                switches=StageSwitches(cache_type_k=Q.Q8_0, cache_type_v=Q.Q8_0))))
    prompt = torch.randint(0, spec.vocab_size, (150,), generator=torch.Generator().manual_seed(3))
    pool = runner.kv_pool(16, 512)
    assert pool.block_bytes == spec.n_layers * 16 * 2 * spec.kv_dim // 32 * 34  # 34 bytes for 32 values
    blocks = pool.blocks

    whole_table = BlockTable(blocks, 256)
    whole = runner.new_sequence(256, whole_table)
    runner.prefill(whole, prompt[:96])
    shared = whole_table.ids[:96 // 16]
    for i in range(3):  # offloaded, and loaded into another block
        data = pool.offload(shared[i])
        (moved,) = blocks.allocate(1)
        pool.load(data, moved)
        shared[i] = moved
    again = runner.new_sequence(256, BlockTable.adopt(blocks, 256, shared), 96)
    assert again.format == whole.format and again.k.dtype == torch.uint8
    rows, rows_again = whole.cells(0, 96), again.cells(0, 96)
    assert not torch.equal(rows, rows_again)  # other cells: the moved blocks
    for cells, cells_again in ((whole.k, again.k), (whole.v, again.v)):
        assert torch.equal(cells_again[:, rows_again], cells[:, rows])
    chains = []
    for kv in (whole, again):
        logits = runner.prefill(kv, prompt[96:])
        chain = [logits]
        for _ in range(16):
            logits = runner.decode([kv], torch.tensor([int(logits.argmax())]))[0]
            chain.append(logits)
        chains.append(chain)
    assert all(torch.equal(a, b) for a, b in zip(*chains, strict=True))


def test_the_options_reach_every_stage_and_a_bad_value_is_refused(tiny_gguf):
    placement = Placement(devices=("cpu",), cache_type_k=Q.Q8_0)
    assert [o.switches.kv_types for o in stage_options(placement, 256, 1024)] == [(Q.Q8_0, Q.BF16)]
    with pytest.raises(ValueError, match="--cache-type-v q4_0"):
        Placement(cache_type_v=Q.Q4_0)
    for command in (["serve", str(tiny_gguf)], ["bench", str(tiny_gguf)], ["info", str(tiny_gguf)]):
        r = CliRunner().invoke(main, [*command, "--cache-type-k", "q4_0"])
        assert r.exit_code == 2 and "--cache-type-k" in r.output and "q4_0" in r.output, r.output
    r = CliRunner().invoke(main, ["info", str(tiny_gguf), "--max-vram", "4", "--devices", "cuda:0",
                                  "--cache-type-k", "q8_0", "--cache-type-v", "q8_0"])
    assert r.exit_code == 0 and "q8_0" in r.output, r.output


def test_the_plan_counts_q8_bytes_and_gives_the_rest_to_resident_experts():
    spec = PRESETS["30b-a3b"].spec("30b-a3b")
    assert kv_bytes(spec, 48, 32768, kv_types=Q8) * 32 == kv_bytes(spec, 48, 32768) * 17  # 34 / 64 of bf16's
    common = dict(n_layers=48, expert_bytes=1_700_000, dense=2 * GiB, budget=16 * GiB, chunk_tokens=4096,
                  kv_tokens=32768, context=65536, staging_buffers=2)
    plain, q8 = plan_memory(spec, **common), plan_memory(spec, **common, kv_types=Q8)
    assert q8.kv * 32 == plain.kv * 17 and q8.kv_staging * 32 == plain.kv_staging * 17
    assert q8.resident_per_layer > plain.resident_per_layer and q8.total <= 16 * GiB
    assert "32,768 tokens, q8_0" in q8.describe()
