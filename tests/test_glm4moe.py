"""glm4moe (GLM-4.5 / GLM-4.5-Air) on the reference forward: against transformers' Glm4MoeForCausalLM
on the same weights (a dense first layer, the ungated shared expert, sigmoid routing with its choice
bias over two expert groups, q/k/v biases, half of each head rotated); stages refuse it in one line;
a malformed file gets a one-line GGUFError naming what is wrong; the engine on `serve --devices cpu`'s
runner draws the reference's greedy chain. llama.cpp's agreement: tests/test_llama_cpp_agrees.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from strata_mgpu.config import Placement
from strata_mgpu.engine.build import build_runner, check_placement, preview_plans
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.runner import DecoderRunner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import preset_spec, write_model
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.model.weights import load_weights
from strata_mgpu.server.dialects import AUTO, GLM45, choose_dialect
from strata_mgpu.stage.device import DeviceError
from tests.engine_runs import assert_engine_draws_the_greedy_chains
from tests.forward_checks import assert_chunks_packs_and_batches_equal_whole, assert_decode_matches_hf
from tests.test_spec import _copy_with, assert_refused_in_one_line


@pytest.fixture(scope="module")
def glm_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-glm4moe.gguf"
    write_model(path, "tiny-glm4moe", seed=3)
    return path


def hf_glm4moe(spec, w):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    r = spec.sigmoid_routing
    cfg = Glm4MoeConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden, intermediate_size=spec.dense_ffn,
        moe_intermediate_size=spec.expert_ffn, num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim, max_position_embeddings=spec.context_length,
        rms_norm_eps=spec.rms_eps, n_routed_experts=spec.n_experts, num_experts_per_tok=spec.n_experts_used,
        n_shared_experts=spec.shared_expert_ffn // spec.expert_ffn, routed_scaling_factor=r.scale,
        n_group=r.n_groups, topk_group=r.groups_used, first_k_dense_replace=spec.leading_dense,
        norm_topk_prob=r.normalize, use_qk_norm=spec.qk_norm, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_base,
                         "partial_rotary_factor": spec.rotary_dim / spec.head_dim})
    cfg._attn_implementation = "eager"
    model = Glm4MoeForCausalLM(cfg).float().eval()
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.out_norm, "lm_head.weight": w.output}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": lw.attn_norm, p + "post_attention_layernorm.weight": lw.ffn_norm,
               p + "self_attn.q_proj.weight": lw.wq, p + "self_attn.k_proj.weight": lw.wk,
               p + "self_attn.v_proj.weight": lw.wv, p + "self_attn.q_proj.bias": lw.bq,
               p + "self_attn.k_proj.bias": lw.bk, p + "self_attn.v_proj.bias": lw.bv,
               p + "self_attn.o_proj.weight": lw.wo}
        if lw.mlp is not None:
            sd |= {p + "mlp.gate_proj.weight": lw.mlp.gate, p + "mlp.up_proj.weight": lw.mlp.up,
                   p + "mlp.down_proj.weight": lw.mlp.down}
        else:
            sd |= {p + "mlp.gate.weight": lw.router, p + "mlp.gate.e_score_correction_bias": lw.expert_bias,
                   p + "mlp.experts.gate_up_proj": torch.cat([lw.gate, lw.up], 1), p + "mlp.experts.down_proj": lw.down,
                   p + "mlp.shared_experts.gate_proj.weight": lw.shared.gate,
                   p + "mlp.shared_experts.up_proj.weight": lw.shared.up,
                   p + "mlp.shared_experts.down_proj.weight": lw.shared.down}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not [m for m in missing if "rotary" not in m] and not unexpected, (missing, unexpected)
    return model


@pytest.fixture(scope="module")
def models(glm_gguf):
    f = GGUFFile(glm_gguf)
    spec = spec_from_gguf(f)
    w = load_weights(f, spec)
    return ReferenceModel(spec, w), hf_glm4moe(spec, w)


def test_the_file_reads_back_as_its_preset_with_glm_4_5s_template(glm_gguf):
    """The reader returns the preset's spec; the file carries GLM-4.5's chat template and its vocabulary
    family, so that `serve` picks the glm45 tool dialect on its own."""
    f = GGUFFile(glm_gguf)
    spec = spec_from_gguf(f)
    assert spec == dataclasses.replace(preset_spec("tiny-glm4moe"), rms_eps=spec.rms_eps)  # stored as float32
    tok = tokenizer_from_gguf(f)
    assert tok.chat_template is not None and choose_dialect(AUTO, tok.chat_template.source) is GLM45
    assert len(tok.encode("<|assistant|>")) == 1


def test_prompt_and_decode_match_transformers(models):
    ours, hf = models
    s = ours.spec
    assert s.arch == "glm4moe" and s.leading_dense == 1 and s.mtp_layers == 1 and s.rotary_dim == 32
    prompt = torch.randint(0, s.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    assert_decode_matches_hf(ours, hf, prompt)


def test_chunks_packs_and_batches_equal_whole_prompts(models):
    assert_chunks_packs_and_batches_equal_whole(models[0])


def test_stages_refuse_glm4moe_in_one_line(glm_gguf):
    f = GGUFFile(glm_gguf)
    spec = spec_from_gguf(f)
    with pytest.raises(DeviceError, match="glm4moe .* CPU reference only") as e:
        build_runner(f, spec, Placement(devices=("cpu",)), 64, kv_tokens=128)
    assert "\n" not in str(e.value)
    with pytest.raises(DeviceError, match="glm4moe .* CPU reference only"):  # `strata info --max-vram`'s plan
        preview_plans(f, spec, Placement(devices=("cuda:0",), max_vram_gib=(16.0,)), 64, 1024)
    check_placement(Placement(devices=("cpu",)), spec)  # `serve --devices cpu`: the reference takes it
    assert isinstance(build_runner(f, spec, Placement(devices=("cpu",)), 64, cpu_reference=True), DecoderRunner)


@pytest.mark.parametrize("change, message", [
    (dict(drop_tensor="blk.2.exp_probs_b.bias"), "missing tensor 'blk.2.exp_probs_b.bias'"),
    (dict(reshape="blk.1.exp_probs_b.bias"), "tensor 'blk.1.exp_probs_b.bias' has shape"),
    (dict(drop_tensor="blk.0.ffn_down.weight"), "missing tensor 'blk.0.ffn_down.weight'"),
    (dict(drop_tensor="blk.3.attn_v.bias"), "missing tensor 'blk.3.attn_v.bias'"),
    (dict(drop_tensor="blk.3.ffn_up_shexp.weight"), "missing tensor 'blk.3.ffn_up_shexp.weight'"),
    (dict(drop_tensor="blk.4.nextn.eh_proj.weight"), "missing tensor 'blk.4.nextn.eh_proj.weight'"),
    (dict(drop_key="glm4moe.expert_shared_count"), "missing metadata key 'glm4moe.expert_shared_count'"),
    # llama.cpp reads no dense layer then: layer 0's router and experts are missing
    (dict(drop_key="glm4moe.leading_dense_block_count"), "missing tensor 'blk.0.exp_probs_b.bias'"),
    (dict(set_key=("glm4moe.expert_gating_func", 1)), "'glm4moe.expert_gating_func' = 1 is not supported"),
    (dict(set_key=("glm4moe.expert_weights_scale", -1.0)), "'glm4moe.expert_weights_scale' = -1.0 must be positive"),
    (dict(set_key=("glm4moe.expert_group_count", 3)), "1 of 3 expert groups do not divide 8 experts"),
    (dict(set_key=("glm4moe.leading_dense_block_count", 5)), "1 MTP blocks and 5 dense layers do not fit 5 blocks"),
])
def test_glm4moe_spec_errors_name_the_problem(glm_gguf, tmp_path, change, message):
    assert_refused_in_one_line(glm_gguf, tmp_path, message, **change)


def test_glm4moe_keys_read_as_llama_cpp_reads_them(glm_gguf, tmp_path):
    """A gating function of 0 (none) is sigmoid, a weights scale of 0 is none (1.0), as llama.cpp's
    glm4moe loader reads them; the written ones are what the reader returns."""
    spec = spec_from_gguf(GGUFFile(glm_gguf))
    r = spec.sigmoid_routing
    assert r is not None and (r.n_groups, r.groups_used, r.normalize, r.scale) == (2, 1, True, 2.5)
    assert spec.attn_bias and not spec.qk_norm and spec.dense_ffn == 512 and spec.shared_expert_ffn == 256
    no_gating = _copy_with(glm_gguf, tmp_path / "none.gguf", set_key=("glm4moe.expert_gating_func", 0))
    assert spec_from_gguf(GGUFFile(no_gating)).sigmoid_routing == r
    no_scale = _copy_with(glm_gguf, tmp_path / "unscaled.gguf", set_key=("glm4moe.expert_weights_scale", 0.0))
    r0 = spec_from_gguf(GGUFFile(no_scale)).sigmoid_routing
    assert r0 is not None and r0.scale == 1.0


def test_the_engine_serves_glm4moe_on_the_cpu_reference_as_the_greedy_chain(glm_gguf):
    """`serve --devices cpu`'s runner: the engine's greedy tokens are the reference's argmax chains."""
    f = GGUFFile(glm_gguf)
    runner = build_runner(f, spec_from_gguf(f), Placement(devices=("cpu",)), 64, cpu_reference=True)
    assert isinstance(runner, DecoderRunner)
    assert_engine_draws_the_greedy_chains(runner, tokenizer_from_gguf(f))


def test_glm_4_5_air_preset_counts_the_model_cards_parameters():
    """The preset's shapes add up to GLM-4.5-Air's model card: 106B parameters, 12B active per token,
    counted without the MTP block (the card's, as transformers loads no MTP layer) and the active
    ones without the embedding and output head (1.24B)."""
    spec = preset_spec("glm-4.5-air")
    mtp = sum(math.prod(s) for name, s in spec.expected_tensors().items() if name.startswith("blk.46."))
    assert (spec.n_layers, spec.mtp_layers, spec.moe_layers[0], spec.rotary_dim) == (46, 1, 1, 64)
    assert spec.n_params - mtp == pytest.approx(106e9, rel=0.01)
    assert spec.n_active_params - 2 * spec.vocab_size * spec.hidden == pytest.approx(12e9, rel=0.02)
