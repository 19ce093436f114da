"""gpt-oss (attention sinks, sliding-window layers between full ones, q/k/v/o and expert biases, the
clamped SwiGLU, the biased top-k-softmax router, YaRN untruncated) on the reference forward: against
transformers' GptOssForCausalLM on the same weights (written by the project's writer, read back),
the strict reader's one-line errors, chunks and packs against whole prompts, the prefix cache through
the engine, gen-model and serve on the CPU, and the stages' refusal."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.config import EngineConfig, Placement
from strata_mgpu.engine.build import build_runner, preview_plans
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model import gpt_oss
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.gpt_oss import clamped_swiglu, sink_attention
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.runner import DecoderRunner, load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import preset_spec, write_model
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.model.weights import load_weights
from strata_mgpu.stage.device import DeviceError
from tests.engine_runs import run_all
from tests.forward_checks import (
    TOL,
    assert_chunks_packs_and_batches_equal_whole,
    assert_decode_matches_hf,
    hf_step,
    rel_err,
)
from tests.hf_oracle import hf_gpt_oss
from tests.server_proc import running_server
from tests.test_spec import _copy_with, assert_refused_in_one_line

WINDOW = preset_spec("tiny-gpt-oss").window(0)  # layer 0 slides


@pytest.fixture(scope="module")
def tiny_gpt_oss_gguf(tmp_path_factory):
    """The tiny-gpt-oss preset: MXFP4 experts, Q8_0 dense weights, F32 biases and sinks."""
    path = tmp_path_factory.mktemp("models") / "tiny-gpt-oss.gguf"
    write_model(path, "tiny-gpt-oss", seed=7)
    return path


@pytest.fixture(scope="module")
def loaded(tiny_gpt_oss_gguf):
    f = GGUFFile(tiny_gpt_oss_gguf)
    spec = spec_from_gguf(f)
    return spec, load_weights(f, spec)


@pytest.fixture(scope="module")
def models(loaded):
    spec, w = loaded
    return ReferenceModel(spec, w), hf_gpt_oss(spec, w)


def test_spec_of_tiny_gpt_oss(tiny_gpt_oss_gguf):
    f = GGUFFile(tiny_gpt_oss_gguf)
    spec = spec_from_gguf(f)
    assert spec == dataclasses.replace(preset_spec("tiny-gpt-oss"), rms_eps=spec.rms_eps)
    assert spec.arch == "gpt-oss" and [spec.window(i) for i in range(4)] == [WINDOW, 0, WINDOW, 0]
    assert not spec.rope_scaling.truncate and spec.rope_scaling.correction_range(64, 150_000.0) != (0, 10)
    assert not spec.fused_attention and spec.reference_only and not spec.hybrid
    types = {name: info.ggml_type for name, info in f.tensors.items()}
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == Q.MXFP4
    assert types["blk.1.attn_q.weight"] == Q.Q8_0 and types["blk.1.attn_sinks.weight"] == Q.F32
    assert types["blk.1.ffn_up_exps.bias"] == types["blk.1.attn_output.bias"] == Q.F32
    assert "blk.0.attn_q_norm.weight" not in types and "blk.0.ffn_norm.weight" not in types


def test_gpt_oss_presets_have_the_released_shapes():
    """openai/gpt-oss-20b: 20.9B parameters, 3.6B active; -120b: 116.8B, 5.1B (less the embedding rows)."""
    embed = 201088 * 2880
    for name, total, active in (("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9)):
        spec = preset_spec(name)
        assert spec.n_params == pytest.approx(total, rel=0.01), name
        assert spec.n_active_params - embed == pytest.approx(active, rel=0.02), name
        assert spec.q_dim == 4096 and spec.kv_dim == 512 and spec.context_length == 131072
        assert [spec.window(i) for i in range(3)] == [128, 0, 128]
    assert preset_spec("gpt-oss-120b", layers=3).n_layers == 3


@pytest.mark.parametrize("change, message", [
    (dict(drop_tensor="blk.1.attn_sinks.weight"), "missing tensor 'blk.1.attn_sinks.weight'"),
    (dict(drop_tensor="blk.2.attn_q.bias"), "missing tensor 'blk.2.attn_q.bias'"),
    (dict(drop_tensor="blk.0.ffn_gate_inp.bias"), "missing tensor 'blk.0.ffn_gate_inp.bias'"),
    (dict(reshape="blk.3.ffn_down_exps.bias"), "tensor 'blk.3.ffn_down_exps.bias' has shape"),
    (dict(reshape="blk.0.attn_sinks.weight"), "tensor 'blk.0.attn_sinks.weight' has shape"),
    (dict(drop_key="gpt-oss.attention.sliding_window"), "missing metadata key 'gpt-oss.attention.sliding_window'"),
    (dict(set_key=("gpt-oss.attention.sliding_window", 0)), "'gpt-oss.attention.sliding_window' = 0 must be positive"),
    (dict(set_key=("gpt-oss.attention.sliding_window", "128")), "'gpt-oss.attention.sliding_window' should be int"),
    (dict(set_key=("gpt-oss.attention.sliding_window_pattern", -2)), "sliding_window_pattern' = -2 must be positive"),
    (dict(add={"blk.0.attn_q_norm.weight": np.ones(64, np.float32)}), "unexpected tensor 'blk.0.attn_q_norm.weight'"),
])
def test_gpt_oss_spec_errors_name_the_problem(tiny_gpt_oss_gguf, tmp_path, change, message):
    assert_refused_in_one_line(tiny_gpt_oss_gguf, tmp_path, message, **change)


def test_a_sliding_window_pattern_key_sets_the_period(tiny_gpt_oss_gguf, tmp_path):
    """llama.cpp's sliding_window_pattern as one period: 4 slides layers 0, 1, 2 and attends all at 3."""
    path = _copy_with(tiny_gpt_oss_gguf, tmp_path / "p4.gguf", set_key=("gpt-oss.attention.sliding_window_pattern", 4))
    spec = spec_from_gguf(GGUFFile(path))
    assert [spec.window(i) for i in range(4)] == [WINDOW, WINDOW, WINDOW, 0]


@torch.no_grad()
def test_clamped_swiglu_is_transformers(loaded):
    """Both sides of both clamps, against GptOssExperts' own gate (gate and up interleaved there)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    spec, _ = loaded
    assert spec.gpt_oss is not None
    limit, alpha = spec.gpt_oss.swiglu_limit, spec.gpt_oss.swiglu_alpha
    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=1,
                                         swiglu_limit=limit, swiglu_alpha=alpha))
    gate, up = torch.linspace(-20, 20, 401), torch.linspace(20, -20, 401)
    want = experts._apply_gate(torch.stack([gate, up], dim=-1).flatten())
    assert torch.equal(clamped_swiglu(gate, up, limit, alpha), want)
    assert (gate > limit).any() and (up < -limit).any() and (up > limit).any()


@pytest.mark.parametrize("window", [0, 5])
def test_sink_attention_in_slices_equals_one_slice(monkeypatch, window):
    """A long chunk's rows attended a few at a time (each slice its own first key) give the same rows."""
    g = torch.Generator().manual_seed(window)
    q, k, v = torch.randn(23, 6, 8, generator=g), torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    sinks = torch.randn(6, generator=g)
    whole = sink_attention(q, k, v, sinks, window)
    monkeypatch.setattr(gpt_oss, "SCORE_ELEMENTS", 6 * 40 * 3)  # 3 rows a slice
    assert torch.allclose(sink_attention(q, k, v, sinks, window), whole, atol=1e-6)
    row = 30 - 17  # query row 13 sits at position 30: with a window of 5 it sees 26..30 only
    if window:
        moved = k.clone()
        moved[:26] += 100  # keys it does not see
        assert torch.allclose(sink_attention(q, moved, v, sinks, window)[row], whole[row], atol=1e-6)


@pytest.mark.parametrize("clamped", [False, True])
@torch.no_grad()
def test_prefill_and_decode_match_transformers(loaded, clamped):
    """A prompt past the window, then decoded tokens, at 1e-4 fp32. `clamped`: the experts' gate and up
    biases scaled up so the SwiGLU's clamps engage (the file's spread seldom reaches 7)."""
    spec, w = loaded
    if clamped:
        w = dataclasses.replace(w, layers=[dataclasses.replace(lw, oss=dataclasses.replace(
            lw.oss, gate_bias=lw.oss.gate_bias * 60, up_bias=lw.oss.up_bias * 60)) for lw in w.layers])
    ours, hf = ReferenceModel(spec, w), hf_gpt_oss(spec, w)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, spec.vocab_size, (3 * WINDOW + 5,), generator=g)
    kv, _ = assert_decode_matches_hf(ours, hf, prompt)
    assert kv.length == prompt.shape[0] + 6
    if clamped:  # the clamps changed the answer: without them it is not transformers'
        assert spec.gpt_oss is not None
        unlimited = dataclasses.replace(spec.gpt_oss, swiglu_limit=1e9)
        loose = ReferenceModel(dataclasses.replace(spec, gpt_oss=unlimited), w)
        unclamped = loose.prefill(prompt, loose.new_cache(256))
        assert rel_err(unclamped, hf_step(hf, prompt[None], None)[0]) > 100 * TOL


def test_chunks_packs_and_batches_equal_whole_prompts(models):
    """A prompt in chunks (one spanning the window's edge at 32, one past two windows), two prompts packed
    in one forward, two sequences decoded in one batch: the logits each has alone."""
    assert_chunks_packs_and_batches_equal_whole(models[0], cuts=(7, WINDOW + 3, 80))


def test_a_conversation_on_the_prefix_cache_draws_the_tokens_of_one_without(tiny_gpt_oss_gguf):
    """Three turns, each the last prompt + its answer + new text, longer than the window: every turn
    after the first starts from cached blocks (the sliding layers' cells are all kept, so any block
    boundary serves) and draws the greedy tokens of an engine without the cache."""
    f = GGUFFile(tiny_gpt_oss_gguf)
    spec = spec_from_gguf(f)
    runner, tok = load_reference_runner(f, spec), tokenizer_from_gguf(f)
    cached = Engine(runner, tok, EngineConfig(chunk_size=40, prefix_block_tokens=16))
    plain = Engine(runner, tok, EngineConfig(chunk_size=40, prefix_block_tokens=16, prefix_cache=False))
    assert cached.prefix is not None and not cached.prefix.stateful
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, spec.vocab_size, (75,), generator=g).tolist()
    for turn in range(3):
        (outs,) = run_all(cached, [(prompt, params)])
        (want,) = run_all(plain, [(prompt, params)])
        got = [t for o in outs for t in o.token_ids]
        assert got == [t for o in want for t in o.token_ids], turn
        t = outs[-1].timings
        assert t.cache_n + t.prompt_n == len(prompt)
        if turn:
            assert t.cache_n > 2 * WINDOW and t.cache_n % 16 == 0, (turn, t.cache_n)
        prompt = prompt + got + torch.randint(0, spec.vocab_size, (20,), generator=g).tolist()
    assert cached.prefix.stats.hits == 2


def test_stages_refuse_gpt_oss_in_one_line(tiny_gpt_oss_gguf):
    """Only the reference computes sinks, windows and the biased experts so far: a stage's placement says so."""
    f = GGUFFile(tiny_gpt_oss_gguf)
    spec = spec_from_gguf(f)
    with pytest.raises(DeviceError, match=r"gpt-oss \(attention sinks.*CPU reference only.*--devices cpu") as e:
        build_runner(f, spec, Placement(devices=("cpu",)), 64, kv_tokens=128)
    assert "\n" not in str(e.value)
    with pytest.raises(DeviceError, match="CPU reference only"):
        preview_plans(f, spec, Placement(devices=("cuda:0",), max_vram_gib=(16.0,)), 64, 1024)  # strata info's
    assert isinstance(build_runner(f, spec, Placement(devices=("cpu",)), 64, cpu_reference=True), DecoderRunner)


def test_gen_model_then_serve_on_the_cpu(tmp_path):
    """`strata gen-model --preset tiny-gpt-oss --layers 3` (MXFP4 experts unasked), then `strata serve
    --devices cpu` answers a chat with greedy tokens through the engine on the reference."""
    from click.testing import CliRunner

    from strata_mgpu.cli import main

    out = tmp_path / "g.gguf"
    r = CliRunner().invoke(main, ["gen-model", str(out), "--preset", "tiny-gpt-oss", "--layers", "3"])
    assert r.exit_code == 0, r.output
    assert "experts MXFP4/MXFP4" in r.output and "untruncated" in r.output
    f = GGUFFile(out)
    spec = spec_from_gguf(f)
    assert spec == dataclasses.replace(preset_spec("tiny-gpt-oss", layers=3), rms_eps=spec.rms_eps)
    with running_server([str(out), "--ctx-size", "1024", "--devices", "cpu"], tmp_path / "serve.log") as base:
        body = {"model": "g", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6,
                "temperature": 0}
        answers = [httpx.post(base + "/v1/chat/completions", json=body, timeout=120) for _ in range(2)]
        assert all(a.status_code == 200 for a in answers), answers[0].text
        first, again = (a.json() for a in answers)
        assert first["usage"]["completion_tokens"] >= 1 and first["choices"][0]["message"]["role"] == "assistant"
        assert again["choices"][0]["message"] == first["choices"][0]["message"]  # greedy: the same answer
    assert "the torch reference forward" in (tmp_path / "serve.log").read_text()
