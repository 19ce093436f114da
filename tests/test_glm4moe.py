"""glm4moe (GLM-4.5 / GLM-4.5-Air) on the reference forward: against transformers' Glm4MoeForCausalLM
on the same weights (a dense first layer, the ungated shared expert, sigmoid routing with its choice
bias over two expert groups, q/k/v biases, half of each head rotated); stages refuse it in one line."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.config import Placement
from strata_mgpu.engine.build import build_runner
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.runner import DecoderRunner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.model.weights import load_weights
from strata_mgpu.stage.device import DeviceError
from tests.test_reference_oracle import TOL, rel_err


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


@torch.no_grad()
def test_prefill_matches_transformers(glm_gguf):
    f = GGUFFile(glm_gguf)
    spec = spec_from_gguf(f)
    assert spec.arch == "glm4moe" and spec.leading_dense == 1 and spec.mtp_layers == 1 and spec.rotary_dim == 32
    w = load_weights(f, spec)
    ours, hf = ReferenceModel(spec, w), hf_glm4moe(spec, w)
    prompt = torch.randint(0, spec.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    assert rel_err(ours.prefill(prompt, ours.new_cache(256)), hf(prompt[None]).logits[0]) <= TOL


def test_stages_refuse_glm4moe_in_one_line(glm_gguf):
    f = GGUFFile(glm_gguf)
    spec = spec_from_gguf(f)
    with pytest.raises(DeviceError, match="glm4moe .* CPU reference only"):
        build_runner(f, spec, Placement(devices=("cpu",)), 64, kv_tokens=128)
    assert isinstance(build_runner(f, spec, Placement(devices=("cpu",)), 64, cpu_reference=True), DecoderRunner)
