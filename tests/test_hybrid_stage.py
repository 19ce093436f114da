"""A hybrid model (qwen35moe, qwen3next: gated DeltaNet + gated attention + a shared expert) on a CPU
stage (the GPU stage's code on the CPU, fp32, the device path's twins): against the reference runner
over prompts, packs and 32 greedy decode steps; the prefix cache's snapshots through the stage; the
stage's KV holding the attention layers only; the memory plan's DeltaNet lines; the split's refusal."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from strata_mgpu.config import EngineConfig, LayerSplit, Placement
from strata_mgpu.engine.build import build_runner, check_placement, dense_layout_bytes, preview_plans
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_pool import BlockTable
from strata_mgpu.model.linear_state import HybridSequence, LinearSnapshot
from strata_mgpu.model.runner import DecoderRunner, load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.state_pool import SCRATCH
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.model.tokenizer import Tokenizer, tokenizer_from_gguf
from strata_mgpu.split.runner import build_split
from strata_mgpu.stage.build import build_stage, dense_storage_bytes
from strata_mgpu.stage.device import DeviceError
from strata_mgpu.stage.graphs.capture import state_slots
from strata_mgpu.stage.graphs.replay import DecodeGraphs
from strata_mgpu.stage.memory_plan import kv_bytes
from strata_mgpu.stage.stage import Stage, StageOptions
from tests.engine_runs import run_all

CPU = torch.device("cpu")
TOL = 1e-4  # max|diff| / max|ref|, fp32 both (measured 0 to 5e-7: the same ops, experts grouped)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module")
def tiny_next_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny-next.gguf"
    write_model(path, "tiny-next", seed=7)
    return path


@pytest.fixture(scope="module", params=["tiny-hybrid", "tiny-next"])
def pair(request, tiny_hybrid_gguf, tiny_next_gguf) -> tuple[DecoderRunner, Stage]:
    f = GGUFFile(tiny_hybrid_gguf if request.param == "tiny-hybrid" else tiny_next_gguf)
    spec = spec_from_gguf(f)
    # two experts a layer resident, the rest streamed through the ring (prompts) or the arena (decode)
    return load_reference_runner(f, spec), build_stage(f, spec, StageOptions(device=CPU))


@torch.no_grad()
def test_a_cpu_stage_equals_the_reference_over_a_prompt_and_32_decode_steps(pair):
    ref, stage = pair
    spec = ref.spec
    assert spec.hybrid and 0 < stage.plan.resident_per_layer < spec.n_experts
    prompt = torch.randint(0, spec.vocab_size, (90,), generator=torch.Generator().manual_seed(0))  # past a scan chunk
    kv_ref, kv_stage = ref.new_sequence(256), stage.new_sequence(256)
    assert isinstance(kv_stage, HybridSequence) and kv_stage.linear.nbytes == spec.linear_state_bytes()
    a, b = ref.prefill(kv_ref, prompt), stage.prefill(kv_stage, prompt)
    assert stage.experts.ring is not None and stage.experts.ring.uploaded_bytes > 0  # the prompt streamed
    assert rel_err(b, a) <= TOL
    for _ in range(32):
        token = torch.tensor([int(a.argmax())])
        a, b = ref.decode([kv_ref], token)[0], stage.decode([kv_stage], token)[0]
        assert rel_err(b, a) <= TOL
    assert kv_stage.length == kv_stage.linear.length == 90 + 32


@torch.no_grad()
def test_a_cpu_stage_equals_the_reference_over_a_pack_and_batched_decode(pair):
    """Three prompts packed in one forward (one shorter than the conv's width), then 32 steps of the
    three decoded as one batch."""
    ref, stage = pair
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, ref.spec.vocab_size, (n,), generator=g) for n in (30, 70, 3)]
    kvs_ref = [ref.new_sequence(256) for _ in chunks]
    kvs_stage = [stage.new_sequence(256) for _ in chunks]
    a, b = ref.prefill_many(kvs_ref, chunks), stage.prefill_many(kvs_stage, chunks)
    assert rel_err(b, a) <= TOL
    for _ in range(32):
        tokens = a.argmax(-1)
        a, b = ref.decode(kvs_ref, tokens), stage.decode(kvs_stage, tokens)
        assert rel_err(b, a) <= TOL


@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_the_batched_decode_step_equals_the_per_sequence_one(pair, batch):
    """Decode steps gather the batch's DeltaNet states by slot and step them at once (`Decoder._delta_rows`);
    the plain twin steps each sequence on its own (`batched_linear_steps` off): 32 greedy steps of
    fresh random prompts, both on the reference, and the stage (batched, the device path's twins)."""
    ref, stage = pair
    spec, model = ref.spec, ref.model
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = torch.randint(2, 80, (batch,), generator=g).tolist()
    chunks = [torch.randint(0, spec.vocab_size, (n,), generator=g) for n in lengths]
    each, at_once = [ref.new_sequence(160) for _ in chunks], [ref.new_sequence(160) for _ in chunks]
    kvs_stage = [stage.new_sequence(160) for _ in chunks]
    a, b, c = ref.prefill_many(each, chunks), ref.prefill_many(at_once, chunks), stage.prefill_many(kvs_stage, chunks)
    for _ in range(32):
        tokens = a.argmax(-1)
        model.batched_linear_steps = False
        try:
            a = ref.decode(each, tokens)
        finally:
            model.batched_linear_steps = True
        b, c = ref.decode(at_once, tokens), stage.decode(kvs_stage, tokens)
        assert rel_err(b, a) <= TOL and rel_err(c, a) <= TOL
    for seq, twin in zip(at_once, each, strict=True):  # the states themselves, layer by layer
        assert isinstance(seq, HybridSequence) and isinstance(twin, HybridSequence)
        for i in seq.linear.layers:
            got, want = seq.linear.layer(i), twin.linear.layer(i)
            assert rel_err(got.recurrent, want.recurrent) <= TOL and rel_err(got.conv, want.conv) <= TOL


def static_steps(stage: Stage, seqs: Sequence[HybridSequence], tokens: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """One decode step of `seqs` through `Decoder.step_static` as a decode graph runs it (positions and
    state slots as tensors, `pad` dummy rows at position 0 on the scratch slot after them), the caches
    and states advanced after: the real rows' output."""
    model = stage.model
    pad_kv = model.new_cache(1, capacity=1)
    caches = [s.kv for s in seqs]
    for kv in caches:
        kv.reserve(1)
    device = stage.ctx.device
    positions = torch.tensor([kv.length for kv in caches] + [0] * pad, device=device)
    slots = torch.tensor([s.linear.slot for s in seqs] + [SCRATCH] * pad, device=device)
    inp = torch.cat([tokens.to(device), torch.zeros(pad, dtype=tokens.dtype, device=device)])
    out = model.step_static(inp, positions, [*caches, *[pad_kv] * pad], None, None, slots)
    for s in seqs:
        s.kv.advance(1)
        s.linear.advance(1)
    return out[:len(seqs)]


@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_the_static_step_of_a_hybrid_equals_its_eager_decode(pair, batch):
    """What a decode graph captures (`Decoder.step_static`: gated row attention, DeltaNet states by slot
    index, a pad row on the scratch slot) against the stage's eager decode over 32 greedy steps."""
    _, stage = pair
    spec = stage.spec
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = torch.randint(2, 80, (batch,), generator=g).tolist()
    chunks = [torch.randint(0, spec.vocab_size, (n,), generator=g) for n in lengths]
    eager = [stage.new_sequence(160) for _ in chunks]
    static = [stage.new_sequence(160) for _ in chunks]
    a = stage.prefill_many(eager, chunks)
    assert rel_err(stage.prefill_many(static, chunks), a) <= TOL
    assert all(isinstance(s, HybridSequence) for s in static)
    for _ in range(32):
        tokens = a.argmax(-1)
        a, b = stage.decode(eager, tokens), static_steps(stage, static, tokens, pad=1)
        assert rel_err(b, a) <= TOL
    assert [s.length for s in static] == [n + 32 for n in lengths]


def continue_from_a_snapshot(stage: Stage, n: int, boundary: int, block_tokens: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LinearSnapshot]:
    """A prompt of n tokens whole, and again as a continuation: the stage's own snapshot (mark_states /
    taken_states) of a first sequence's state at `boundary` (a block boundary), restored into a new
    sequence on that sequence's blocks (new_sequence(..., state=)), the prompt's rest after it, then one
    step decoded on both. (whole prompt's logits, continuation's, whole's step, continuation's, snapshot)."""
    prompt = torch.randint(0, stage.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(2))
    pool = stage.kv_pool(block_tokens, 4 * n)
    whole = stage.new_sequence(2 * n)
    want = stage.prefill(whole, prompt)
    first_table = BlockTable(pool.blocks, 2 * n)
    first = stage.new_sequence(2 * n, first_table)
    stage.mark_states(first, [boundary])
    stage.prefill(first, prompt[:boundary + block_tokens // 2])
    (snap,) = stage.taken_states(first).values()
    assert snap.length == boundary and stage.taken_states(first) == {}  # handed over once
    table = BlockTable.adopt(pool.blocks, 2 * n, first_table.ids[:boundary // block_tokens])
    again = stage.new_sequence(2 * n, table, boundary, state=snap)
    got = stage.prefill(again, prompt[boundary:])
    step = torch.tensor([int(want.argmax())], device=stage.ctx.device)
    return want, got, stage.decode([whole], step)[0], stage.decode([again], step)[0], snap


@torch.no_grad()
def test_a_continuation_from_a_snapshot_through_the_stage_equals_the_whole_prompt(pair):
    _, stage = pair
    want, got, want_step, got_step, _ = continue_from_a_snapshot(stage, 100, 64, 16)
    assert rel_err(got, want) <= TOL and rel_err(got_step, want_step) <= TOL


def three_turns_cached_and_not(stage: Stage, tok: Tokenizer) -> None:
    """A conversation of three turns on an engine with the prefix cache: each later turn starts from a
    cached snapshot (the last turn's last full block, or one every `state_every` tokens) and draws the
    greedy tokens an engine without the cache draws on the same stage."""
    cached = Engine(stage, tok, EngineConfig(chunk_size=40, prefix_block_tokens=16))
    assert cached.prefix is not None and cached.prefix.stateful
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, stage.spec.vocab_size, (75,), generator=g).tolist()
    turns = []
    for _ in range(3):
        (outs,) = run_all(cached, [(prompt, params)])
        got = [t for o in outs for t in o.token_ids]
        turns.append((prompt, got, outs[-1].timings))
        prompt = prompt + got + torch.randint(0, stage.spec.vocab_size, (20,), generator=g).tolist()
    assert cached.prefix.stats.states >= 3 and cached.prefix.stats.hits == 2
    plain = Engine(stage, tok, EngineConfig(chunk_size=40, prefix_block_tokens=16, prefix_cache=False))
    for turn, (prompt, got, timings) in enumerate(turns):
        (want,) = run_all(plain, [(prompt, params)])
        assert got == [t for o in want for t in o.token_ids], turn
        assert timings.cache_n + timings.prompt_n == len(prompt)
        assert (timings.cache_n > 0) == (turn > 0) and timings.cache_n % 16 == 0


def test_three_turns_through_the_stage_and_its_prefix_cache_equal_the_cacheless_engine(tiny_hybrid_gguf):
    f = GGUFFile(tiny_hybrid_gguf)
    spec = spec_from_gguf(f)
    three_turns_cached_and_not(build_stage(f, spec, StageOptions(device=CPU, kv_tokens=1024)), tokenizer_from_gguf(f))


def test_the_stage_keeps_kv_for_attention_layers_only_and_plans_the_state(tiny_hybrid_gguf):
    f = GGUFFile(tiny_hybrid_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, kv_tokens=1024, sequences=5))
    n_attention = len(spec.attention_layers)
    assert 0 < n_attention < spec.n_layers
    pool = stage.kv_pool(64, 0)
    assert pool.storage.k.shape[0] == n_attention
    plan = stage.plan
    assert plan.kv == kv_bytes(spec, n_attention, plan.kv_tokens, 4)
    lines = dict(plan.lines())
    assert lines["DeltaNet state (5 sequences)"] == 5 * spec.linear_state_bytes() == plan.linear_state > 0
    assert plan.fixed >= plan.linear_state + plan.kv + plan.dense
    # the dense line counts the DeltaNet mixers and the shared experts, as built and as previewed
    assert plan.dense == dense_storage_bytes(stage.model.w)
    assert dense_layout_bytes(f, spec, range(spec.n_layers), elem=4, blocks=False) == plan.dense
    (_, _, preview), = preview_plans(f, spec, Placement(devices=("cuda:0",), max_vram_gib=(8.0,)), 64, 1024,
                                     sequences=3)
    assert dict(preview.lines())["DeltaNet state (3 sequences)"] == 3 * spec.linear_state_bytes()


def test_a_layer_split_of_a_hybrid_model_is_refused_in_one_line(tiny_hybrid_gguf):
    f = GGUFFile(tiny_hybrid_gguf)
    spec = spec_from_gguf(f)
    split = Placement(devices=("cpu", "cpu"), layer_split=LayerSplit((2,)))
    for refused in (lambda: check_placement(split, spec), lambda: build_runner(f, spec, split, 64, kv_tokens=128),
                    lambda: build_split(f, spec, [StageOptions(device=CPU)] * 2, LayerSplit((2,))),
                    lambda: preview_plans(f, spec, Placement(devices=("cuda:0", "cuda:1"), max_vram_gib=(8.0, 8.0)),
                                          64, 1024)):
        with pytest.raises(DeviceError, match="cannot be split across stages") as e:
            refused()
        assert "\n" not in str(e.value)
    check_placement(Placement(devices=("cpu",)), spec)  # one device: served
    assert isinstance(build_runner(f, spec, Placement(devices=("cpu",)), 64, kv_tokens=128), Stage)


@torch.no_grad()
def test_hybrid_graph_bookkeeping_without_cuda(tiny_hybrid_gguf, monkeypatch):
    """What runs of a hybrid decode graph without a GPU: its slot index as a replay loads it (rows'
    slots, then the scratch slot for pad rows), which batches the graphs serve (every row's state
    given, none to record a snapshot after this token), and a step that runs out of memory with graphs
    captured: graphs dropped, the error raised, no rerun over advanced states."""
    f = GGUFFile(tiny_hybrid_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, kv_tokens=1024, sequences=4))
    seqs = [stage.new_sequence(64) for _ in range(3)]
    assert all(isinstance(s, HybridSequence) for s in seqs)
    linear = [s.linear for s in seqs]  # type: ignore[union-attr]
    caches = [s.kv for s in seqs]  # type: ignore[union-attr]
    assert state_slots(linear, 4) == [st.slot for st in linear] + [SCRATCH] and state_slots(None, 2) == [SCRATCH] * 2
    assert SCRATCH not in [st.slot for st in linear]
    graphs = DecodeGraphs(stage.ctx, stage.model, enabled=True, largest=4, pad=False, first=True)  # 3 rows gather
    assert graphs.serves(caches, linear) and not graphs.serves(caches) and not graphs.serves(caches, linear[:2])
    linear[1].mark(1)  # a snapshot after the next token: the eager step records it
    assert not graphs.serves(caches, linear)

    def out_of_memory(kvs, inp):
        raise torch.OutOfMemoryError("out of memory (simulated)")

    monkeypatch.setattr(stage, "_decode_rows", out_of_memory)
    monkeypatch.setitem(stage.graphs.captured, 1, None)  # as if a graph were captured
    with pytest.raises(torch.OutOfMemoryError, match="hybrid model.*not run again"):
        stage.decode_rows(seqs, torch.zeros(3, dtype=torch.long))
    assert stage.graphs.captured == {} and [s.length for s in seqs] == [0, 0, 0]
