"""qwen35moe (gated DeltaNet + gated attention + a shared expert) on the reference forward: against
transformers' Qwen3_5MoeForCausalLM on the same weights (qwen3next against Qwen3NextForCausalLM),
the chunked scan against the recurrence, chunks and packs against whole prompts, and the DeltaNet
state's snapshot against the sequence it was taken from."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import torch

from strata_mgpu.config import EngineConfig, Placement
from strata_mgpu.engine.build import build_runner, preview_plans
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.delta_net import delta_rule_chunked, delta_rule_steps, l2norm
from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.runner import DecoderRunner, load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import PRESETS, preset_spec, write_model
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.model.weights import load_weights
from tests.engine_runs import assert_engine_draws_the_greedy_chains, run_all
from tests.forward_checks import assert_chunks_packs_and_batches_equal_whole, assert_decode_matches_hf, rel_err
from tests.hf_oracle import hf_qwen3next, hf_qwen35moe
from tests.server_proc import running_server
from tests.test_spec import _copy_with, assert_refused_in_one_line


def copy_prefix(src, dst, n: int) -> None:
    """The first n positions of a plain cache's every layer into a fresh one, which then holds n."""
    dst.reserve(n)
    dst.k[:, :n].copy_(src.k[:, :n])
    dst.v[:, :n].copy_(src.v[:, :n])
    dst.advance(n)


@pytest.fixture(scope="module")
def models(tiny_hybrid_gguf):
    f = GGUFFile(tiny_hybrid_gguf)
    spec = spec_from_gguf(f)
    w = load_weights(f, spec)
    return ReferenceModel(spec, w), hf_qwen35moe(spec, w)


def test_spec_of_tiny_hybrid(tiny_hybrid_gguf):
    spec = spec_from_gguf(GGUFFile(tiny_hybrid_gguf))
    expected = PRESETS["tiny-hybrid"].spec("strata-synthetic-tiny-hybrid")
    assert spec == dataclasses.replace(expected, rms_eps=spec.rms_eps)
    assert spec.arch == "qwen35moe" and spec.attention_layers == [1, 3] and spec.rotary_dim == 16
    assert not spec.fused_attention


def test_35b_a3b_hybrid_shapes():
    spec = preset_spec("35b-a3b-hybrid")
    assert spec.attention_layers == list(range(3, 40, 4))
    assert spec.n_params == pytest.approx(35.5e9, rel=0.01)  # the text model and its MTP block
    assert spec.mtp_layers == 1 and spec.expected_tensors()["blk.40.nextn.eh_proj.weight"] == (2048, 4096)
    assert spec.expected_tensors()["blk.40.attn_q.weight"] == (2 * 16 * 256, 2048)  # MTP: an attention block
    assert spec.n_active_params - spec.vocab_size * spec.hidden == pytest.approx(3.0e9, rel=0.1)  # A3B, less embd
    assert spec.linear_state_bytes() == 30 * (8192 * 3 + 32 * 128 * 128) * 4  # fp32, one sequence
    assert preset_spec("35b-a3b-hybrid", layers=5).attention_layers == [3]


@pytest.mark.parametrize("change, message", [
    (dict(drop_tensor="blk.0.ssm_a"), "missing tensor 'blk.0.ssm_a'"),
    (dict(drop_tensor="blk.2.ssm_dt.bias"), "missing tensor 'blk.2.ssm_dt.bias'"),
    (dict(drop_tensor="blk.1.ffn_up_shexp.weight"), "missing tensor 'blk.1.ffn_up_shexp.weight'"),
    (dict(reshape="blk.0.attn_qkv.weight"), "tensor 'blk.0.attn_qkv.weight' has shape"),
    (dict(reshape="blk.1.attn_q.weight"), "tensor 'blk.1.attn_q.weight' has shape"),
    (dict(drop_key="qwen35moe.ssm.group_count"), "missing metadata key 'qwen35moe.ssm.group_count'"),
    (dict(drop_tensor="blk.4.nextn.eh_proj.weight"), "missing tensor 'blk.4.nextn.eh_proj.weight'"),
    (dict(drop_key="qwen35moe.nextn_predict_layers"), "missing tensor 'blk.4.ssm_"),  # blk.4: a 5th layer then
])
def test_hybrid_spec_errors_name_the_problem(tiny_hybrid_gguf, tmp_path, change, message):
    assert_refused_in_one_line(tiny_hybrid_gguf, tmp_path, message, **change)


def test_an_mtp_block_may_have_its_own_embedding_and_head(tiny_hybrid_gguf, tmp_path):
    """llama.cpp's optional nextn tensors: taken where they fit, refused where misshapen or elsewhere."""
    import numpy as np

    V, D = PRESETS["tiny-hybrid"].vocab_size, PRESETS["tiny-hybrid"].hidden
    ok = _copy_with(tiny_hybrid_gguf, tmp_path / "ok.gguf", add={
        "blk.4.nextn.embed_tokens.weight": np.zeros((V, D), np.float32),
        "blk.4.nextn.shared_head_head.weight": np.zeros((V, D), np.float32)})
    assert spec_from_gguf(GGUFFile(ok)).mtp_layers == 1
    bad = _copy_with(tiny_hybrid_gguf, tmp_path / "bad.gguf",
                     add={"blk.4.nextn.embed_tokens.weight": np.zeros((V, D // 2), np.float32)})
    with pytest.raises(GGUFError, match="tensor 'blk.4.nextn.embed_tokens.weight' has shape"):
        spec_from_gguf(GGUFFile(bad))
    elsewhere = _copy_with(tiny_hybrid_gguf, tmp_path / "elsewhere.gguf",
                           add={"blk.3.nextn.embed_tokens.weight": np.zeros((V, D), np.float32)})
    with pytest.raises(GGUFError, match="unexpected tensor 'blk.3.nextn.embed_tokens.weight'"):
        spec_from_gguf(GGUFFile(elsewhere))


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 150])
def test_chunked_scan_equals_the_recurrence(n):
    g = torch.Generator().manual_seed(n)
    h, dk, dv = 4, 16, 8
    q, k = (l2norm(torch.randn(n, h, dk, generator=g)) for _ in range(2))
    v = torch.randn(n, h, dv, generator=g)
    decay = -3 * torch.rand(n, h, generator=g)  # some heads forget fast
    beta = torch.rand(n, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    out, end = delta_rule_chunked(q, k, v, decay, beta, state)
    ref, ref_end = delta_rule_steps(q, k, v, decay, beta, state)
    assert rel_err(out, ref) <= 1e-5 and rel_err(end, ref_end) <= 1e-5


@pytest.fixture(scope="module")
def next_models(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-next.gguf"
    write_model(path, "tiny-next", seed=7)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    w = load_weights(f, spec)
    return ReferenceModel(spec, w), hf_qwen3next(spec, w)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_prefill_and_decode_match_transformers(arch, request):
    """A prompt past one chunk of the scan, then decoded tokens through the one-step recurrence."""
    ours, hf = request.getfixturevalue("models" if arch == "qwen35moe" else "next_models")
    assert ours.spec.arch == arch
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prompt = torch.randint(0, ours.spec.vocab_size, (83,), generator=g)
    kv, linear = assert_decode_matches_hf(ours, hf, prompt)
    assert kv.k.shape[0] == 2  # the full-attention layers only
    assert kv.length == linear.length == 83 + 6


def test_chunks_packs_and_batches_equal_whole_prompts(models):
    """A prompt in three chunks (one of them past a scan chunk), two prompts packed in one forward, and
    two sequences decoded in one batch: the logits each has alone."""
    assert_chunks_packs_and_batches_equal_whole(models[0])


@torch.no_grad()
def test_a_snapshot_restored_into_a_fresh_sequence_continues_as_the_original(models):
    """The DeltaNet state copied at token 64 (with the KV cells of those 64 positions) and restored
    into a fresh sequence: the same logits as the original's, bit for bit, for the rest of the prompt
    and the decoded tokens."""
    ours, _ = models
    V = ours.spec.vocab_size
    prompt, rest = torch.randint(0, V, (64,)), torch.randint(0, V, (19,))
    kv, linear = ours.new_cache(256), ours.new_linear_state()
    assert linear is not None
    ours.prefill(prompt, kv, linear)
    snap = linear.snapshot()
    kv2 = ours.new_cache(256)
    copy_prefix(kv, kv2, 64)  # as the prefix cache shares or copies its KV blocks
    original = ours.prefill(rest, kv, linear)
    more = [ours.prefill(t[None], kv, linear) for t in (original[-1].argmax(), torch.tensor(3))]

    linear2 = ours.new_linear_state()
    assert linear2 is not None
    linear2.restore(snap)
    assert torch.equal(ours.prefill(rest, kv2, linear2), original)
    for t, ref in zip((original[-1].argmax(), torch.tensor(3)), more, strict=True):
        assert torch.equal(ours.prefill(t[None], kv2, linear2), ref)
    with pytest.raises(ValueError, match="DeltaNet state at its KV's length"):
        ours.forward(rest, [Segment(0, rest.shape[0], ours.new_cache(256))])  # no state


def test_a_hybrid_conversation_continues_from_its_cached_snapshots(tiny_hybrid_gguf):
    """Three turns on the prefix cache of a hybrid model: a later turn starts at the deepest cached block
    that carries a snapshot of the DeltaNet state (a prompt's last full block, or every `state_every`
    tokens), restores it with the blocks, and draws the greedy tokens an engine without the cache draws."""
    f = GGUFFile(tiny_hybrid_gguf)
    spec = spec_from_gguf(f)
    runner, tok = load_reference_runner(f, spec), tokenizer_from_gguf(f)
    cached = Engine(runner, tok, EngineConfig(chunk_size=40, prefix_block_tokens=16))
    plain = Engine(runner, tok, EngineConfig(chunk_size=40, prefix_block_tokens=16, prefix_cache=False))
    assert cached.prefix is not None and cached.prefix.stateful and cached.state_every % 16 == 0
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, spec.vocab_size, (75,), generator=g).tolist()
    last_block = 0
    for turn in range(3):
        (outs,) = run_all(cached, [(prompt, params)])
        (want,) = run_all(plain, [(prompt, params)])
        got = [t for o in outs for t in o.token_ids]
        assert got == [t for o in want for t in o.token_ids], turn
        t = outs[-1].timings
        assert t.cache_n + t.prompt_n == len(prompt)
        if turn:  # the last turn's prompt up to its last full block: its snapshot
            assert t.cache_n >= last_block and t.cache_n % 16 == 0, (turn, t.cache_n, last_block)
        last_block = len(prompt) // 16 * 16
        prompt = prompt + got + torch.randint(0, spec.vocab_size, (20,), generator=g).tolist()
    assert cached.prefix.stats.states >= 3 and cached.prefix.stats.hits == 2


def test_a_hybrid_sequence_counts_its_state(models):
    ours, _ = models
    seq = DecoderRunner(ours).new_sequence(128)
    seq.kv.reserve(1)  # one block of the attention layers' pool
    assert seq.nbytes == seq.kv.nbytes + ours.spec.linear_state_bytes()


def test_the_engine_chunks_and_batches_a_hybrid_model_as_the_greedy_chain(tiny_hybrid_gguf):
    f = GGUFFile(tiny_hybrid_gguf)
    assert_engine_draws_the_greedy_chains(load_reference_runner(f, spec_from_gguf(f)), tokenizer_from_gguf(f))


def test_strata_serve_answers_a_chat_with_a_hybrid_model(tiny_hybrid_gguf, tmp_path):
    with running_server([str(tiny_hybrid_gguf), "--ctx-size", "1024", "--devices", "cpu"],
                        tmp_path / "serve.log") as base:
        body = {"model": "tiny-hybrid", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6,
                "temperature": 0}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["usage"]["completion_tokens"] >= 1 and answer["choices"][0]["message"]["role"] == "assistant"
    assert "the torch reference forward" in (tmp_path / "serve.log").read_text()


def test_serve_on_one_cpu_keeps_the_reference_for_a_hybrid_model(tiny_hybrid_gguf):
    """`serve --devices cpu` (cpu_reference) runs a hybrid model on the fp32 reference; a stage serves it
    elsewhere (tests/test_hybrid_stage.py), and `strata info --max-vram` plans it."""
    f = GGUFFile(tiny_hybrid_gguf)
    spec = spec_from_gguf(f)
    assert isinstance(build_runner(f, spec, Placement(devices=("cpu",)), 64, cpu_reference=True), DecoderRunner)
    (_, _, plan), = preview_plans(f, spec, Placement(devices=("cuda:0",), max_vram_gib=(16.0,)), 64, 1024)
    assert plan.linear_state > 0


def test_gen_model_writes_a_cut_of_a_hybrid_preset(tmp_path):
    """`--layers 2` of tiny-hybrid: one DeltaNet layer then one attention layer, a file the strict
    reader takes and the reference runs (35b-a3b-hybrid's cut is the same code at ~0.85 GB a layer)."""
    from click.testing import CliRunner

    from strata_mgpu.cli import main

    out = tmp_path / "h.gguf"
    r = CliRunner().invoke(main, ["gen-model", str(out), "--preset", "tiny-hybrid", "--layers", "2"])
    assert r.exit_code == 0, r.output
    f = GGUFFile(out)
    spec = spec_from_gguf(f)
    assert spec == dataclasses.replace(preset_spec("tiny-hybrid", layers=2), rms_eps=spec.rms_eps)
    assert spec.attention_layers == [1]
    runner = load_reference_runner(f, spec)
    logits = runner.prefill(runner.new_sequence(64), torch.arange(10))
    assert logits.shape == (spec.vocab_size,) and bool(torch.isfinite(logits).all())


@torch.no_grad()
def test_snapshots_recorded_at_block_boundaries_inside_a_chunk(models):
    """A 150-token prompt in one forward, its state marked at 64 and 128: the snapshot at 128 is the
    state of the same 128 tokens prefilled alone, and a fresh sequence restored from it (with the KV
    cells of those 128 positions) continues with the prompt's rest and decodes as the original."""
    ours, _ = models
    V = ours.spec.vocab_size
    prompt = torch.randint(0, V, (150,))
    kv, linear = ours.new_cache(256), ours.new_linear_state()
    assert linear is not None
    linear.mark(64, 128, 150, 999)
    original = ours.prefill(prompt, kv, linear)
    at_64, at_128, at_end = linear.taken(64), linear.taken(128), linear.taken(150)
    assert at_64 is not None and at_128 is not None and at_end is not None and linear.taken(999) is None
    assert linear.taken(128) is None  # handed over once
    end = linear.snapshot()
    for i, s in end.layers.items():  # recorded after the last row: the state the forward ends with
        assert torch.equal(at_end.layers[i].recurrent, s.recurrent) and torch.equal(at_end.layers[i].conv, s.conv)

    alone = ours.new_linear_state()
    assert alone is not None
    ours.prefill(prompt[:128], ours.new_cache(256), alone)
    for i, s in alone.snapshot().layers.items():
        got = at_128.layers[i]
        assert rel_err(got.recurrent, s.recurrent) <= 1e-5 and rel_err(got.conv, s.conv) <= 1e-5

    kv2, linear2 = ours.new_cache(256), ours.new_linear_state()
    assert linear2 is not None
    copy_prefix(kv, kv2, 128)
    linear2.restore(at_128)
    assert rel_err(ours.prefill(prompt[128:], kv2, linear2), original[128:]) <= 1e-5
    nxt = original[-1].argmax()[None]
    assert rel_err(ours.prefill(nxt, kv2, linear2), ours.prefill(nxt, kv, linear)) <= 1e-5
