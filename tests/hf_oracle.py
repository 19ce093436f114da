"""Build Hugging Face transformers' Qwen3-MoE with our spec and the same dequantized weights."""

from __future__ import annotations

import torch
from gguf.constants import RopeScalingType

from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.weights import ModelWeights


def hf_qwen3moe(spec: ModelSpec, w: ModelWeights):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden, intermediate_size=spec.expert_ffn,
        moe_intermediate_size=spec.expert_ffn, num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim, max_position_embeddings=spec.context_length,
        rms_norm_eps=spec.rms_eps, rope_theta=spec.rope_base, num_experts=spec.n_experts,
        num_experts_per_tok=spec.n_experts_used, norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=spec.tied_output, attention_bias=False,
    )
    cfg.rope_parameters = rope_parameters(spec)
    cfg._attn_implementation = "eager"
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.out_norm, "lm_head.weight": w.output}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": lw.attn_norm, p + "post_attention_layernorm.weight": lw.ffn_norm,
            p + "self_attn.q_proj.weight": lw.wq, p + "self_attn.k_proj.weight": lw.wk,
            p + "self_attn.v_proj.weight": lw.wv, p + "self_attn.o_proj.weight": lw.wo,
            p + "self_attn.q_norm.weight": lw.q_norm, p + "self_attn.k_norm.weight": lw.k_norm,
            p + "mlp.gate.weight": lw.router,
            p + "mlp.experts.gate_up_proj": torch.cat([lw.gate, lw.up], dim=1),
            p + "mlp.experts.down_proj": lw.down,
        }
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    return model


def rope_parameters(spec: ModelSpec) -> dict:
    """transformers' `rope_parameters` for the spec's RoPE: transformers derives the frequencies
    and YaRN's attention factor itself from factor, original context and betas (no
    `attention_factor` passed, so the comparison checks ours), except where attn_factor (llama.cpp's
    extra multiplier, with no transformers key) is not 1: `attention_factor` then carries our product."""
    r = spec.rope_scaling
    params: dict = {"rope_type": r.kind.value if r.kind != RopeScalingType.NONE else "default",
                    "rope_theta": spec.rope_base}
    if r.kind != RopeScalingType.NONE:
        params["factor"] = r.factor
    if r.kind == RopeScalingType.YARN:
        params |= {"original_max_position_embeddings": r.original_context, "beta_fast": r.beta_fast,
                   "beta_slow": r.beta_slow}
        if r.attn_factor != 1.0:
            params["attention_factor"] = r.mscale
    assert r.attn_factor == 1.0 or r.kind == RopeScalingType.YARN, "transformers has no attn_factor here"
    return params
