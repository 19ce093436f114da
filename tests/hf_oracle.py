"""Build Hugging Face transformers' Qwen3-MoE (and the other archs' models) with our spec and the same
dequantized weights."""

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
    return _loaded(model, sd)


def _loaded(model, sd: dict):
    """The model with `sd` loaded: every weight given (the rotary buffers excepted), nothing else."""
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
        if not r.truncate:  # gpt-oss's
            params["truncate"] = False
    assert r.attn_factor == 1.0 or r.kind == RopeScalingType.YARN, "transformers has no attn_factor here"
    return params


def _grouped(t: torch.Tensor, dim: int, n_k: int, n_v: int, head: int) -> torch.Tensor:
    """Value heads along `dim` from the file's tiled order (head j = v Hk + k) back to transformers'
    grouped one (k r + v): the inverse of llama.cpp's converter's reorder."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], n_v // n_k, n_k, head, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _hybrid_config(spec: ModelSpec) -> dict:
    """The config keys Qwen3_5MoeTextConfig and Qwen3NextConfig share, from the spec."""
    d = spec.delta
    assert d is not None
    return dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length, rms_norm_eps=spec.rms_eps, tie_word_embeddings=spec.tied_output,
        linear_conv_kernel_dim=d.conv_kernel, linear_key_head_dim=d.k_head_dim, linear_value_head_dim=d.v_head_dim,
        linear_num_key_heads=d.n_k_heads, linear_num_value_heads=d.n_v_heads, moe_intermediate_size=spec.expert_ffn,
        shared_expert_intermediate_size=spec.shared_expert_ffn, num_experts_per_tok=spec.n_experts_used,
        num_experts=spec.n_experts,
        layer_types=["linear_attention" if spec.is_linear(i) else "full_attention" for i in range(spec.n_layers)])


def _hybrid_layer(p: str, lw) -> dict:
    """A hybrid layer's norms, MoE block and (where it is one) attention, as both transformers classes
    name them (prefix `p`); RMSNorm weights less the 1 the converter adds."""
    assert lw.gate is not None and lw.up is not None and lw.shared is not None
    sd = {
        p + "input_layernorm.weight": lw.attn_norm - 1, p + "post_attention_layernorm.weight": lw.ffn_norm - 1,
        p + "mlp.gate.weight": lw.router,
        p + "mlp.experts.gate_up_proj": torch.cat([lw.gate, lw.up], dim=1),
        p + "mlp.experts.down_proj": lw.down,
        p + "mlp.shared_expert.gate_proj.weight": lw.shared.gate,
        p + "mlp.shared_expert.up_proj.weight": lw.shared.up,
        p + "mlp.shared_expert.down_proj.weight": lw.shared.down,
        p + "mlp.shared_expert_gate.weight": lw.shared.gate_inp[None],
    }
    if lw.delta is None:
        assert lw.q_norm is not None and lw.k_norm is not None
        sd |= {p + "self_attn.q_proj.weight": lw.wq, p + "self_attn.k_proj.weight": lw.wk,
               p + "self_attn.v_proj.weight": lw.wv, p + "self_attn.o_proj.weight": lw.wo,
               p + "self_attn.q_norm.weight": lw.q_norm - 1, p + "self_attn.k_norm.weight": lw.k_norm - 1}
    return sd


def hf_qwen35moe(spec: ModelSpec, w: ModelWeights):
    """transformers' Qwen3_5MoeForCausalLM with the weights a qwen35moe GGUF holds, mapped back as
    llama.cpp's converter maps them forward (RMSNorm weights less 1 but the gated norm's,
    A_log = log(-ssm_a), value heads regrouped)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    d = spec.delta
    assert d is not None
    cfg = Qwen3_5MoeTextConfig(
        **_hybrid_config(spec),
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_base,
                         "partial_rotary_factor": spec.rotary_dim / spec.head_dim,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    )
    cfg._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    assert w.out_norm is not None
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.out_norm - 1, "lm_head.weight": w.output}
    nk, nv, qk = d.n_k_heads, d.n_v_heads, 2 * d.key_dim

    def v_rows(t: torch.Tensor) -> torch.Tensor:  # q and k channels as they are, v's regrouped
        return torch.cat([t[:qk], _grouped(t[qk:], 0, nk, nv, d.v_head_dim)])

    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        sd |= _hybrid_layer(p, lw)
        if lw.delta is None:
            continue
        ld = lw.delta
        assert isinstance(ld.wqkv, torch.Tensor) and isinstance(ld.wz, torch.Tensor)
        assert isinstance(ld.wout, torch.Tensor)
        sd |= {
            p + "linear_attn.in_proj_qkv.weight": v_rows(ld.wqkv),
            p + "linear_attn.in_proj_z.weight": _grouped(ld.wz, 0, nk, nv, d.v_head_dim),
            p + "linear_attn.in_proj_b.weight": _grouped(ld.w_beta, 0, nk, nv, 1),
            p + "linear_attn.in_proj_a.weight": _grouped(ld.w_alpha, 0, nk, nv, 1),
            p + "linear_attn.A_log": _grouped(torch.log(-ld.decay_rate), 0, nk, nv, 1),
            p + "linear_attn.dt_bias": _grouped(ld.dt_bias, 0, nk, nv, 1),
            p + "linear_attn.conv1d.weight": v_rows(ld.conv)[:, None],
            p + "linear_attn.norm.weight": ld.norm,
            p + "linear_attn.out_proj.weight": _grouped(ld.wout, 1, nk, nv, d.v_head_dim),
        }
    return _loaded(model, sd)


def hf_qwen3next(spec: ModelSpec, w: ModelWeights):
    """transformers' Qwen3NextForCausalLM with a qwen3next GGUF's weights: its in_proj_qkvz and
    in_proj_ba interleave each key head's q, k, v, z (and b, a), which llama.cpp's converter splits
    into attn_qkv / attn_gate (and keeps as ssm_ba); value heads stay grouped."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    d = spec.delta
    assert d is not None and not d.v_tiled
    cfg = Qwen3NextConfig(
        **_hybrid_config(spec),
        intermediate_size=spec.expert_ffn, norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_base,
                         "partial_rotary_factor": spec.rotary_dim / spec.head_dim},
    )
    cfg._attn_implementation = "eager"
    model = Qwen3NextForCausalLM(cfg).float().eval()
    assert w.out_norm is not None
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.out_norm - 1, "lm_head.weight": w.output}
    nk, r, D = d.n_k_heads, d.n_v_heads // d.n_k_heads, spec.hidden
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        sd |= _hybrid_layer(p, lw)
        if lw.delta is None:
            continue
        ld = lw.delta
        assert isinstance(ld.wqkv, torch.Tensor) and isinstance(ld.wz, torch.Tensor)
        q, k, v = ld.wqkv.split([d.key_dim, d.key_dim, d.value_dim])
        per_head = [q.view(nk, -1, D), k.view(nk, -1, D), v.view(nk, -1, D), ld.wz.view(nk, -1, D)]
        sd |= {
            p + "linear_attn.in_proj_qkvz.weight": torch.cat(per_head, dim=1).reshape(-1, D),
            p + "linear_attn.in_proj_ba.weight": torch.cat([ld.w_beta.view(nk, r, D), ld.w_alpha.view(nk, r, D)],
                                                           dim=1).reshape(-1, D),
            p + "linear_attn.A_log": torch.log(-ld.decay_rate), p + "linear_attn.dt_bias": ld.dt_bias,
            p + "linear_attn.conv1d.weight": ld.conv[:, None], p + "linear_attn.norm.weight": ld.norm,
            p + "linear_attn.out_proj.weight": ld.wout,
        }
    return _loaded(model, sd)


def hf_gpt_oss(spec: ModelSpec, w: ModelWeights):
    """transformers' GptOssForCausalLM with a gpt-oss GGUF's weights, mapped back as llama.cpp's converter
    maps them forward: the experts' gate and up (and their biases) interleaved again into gate_up_proj,
    column 2f gate f and 2f + 1 up f, and every expert matrix transposed ([E, in, out])."""
    from transformers import GptOssConfig, GptOssForCausalLM

    oss = spec.gpt_oss
    assert oss is not None and oss.swa_period == 2, "transformers' default layer_types: sliding, full, ..."
    cfg = GptOssConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden, intermediate_size=spec.expert_ffn,
        num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.context_length, rms_norm_eps=spec.rms_eps,
        num_local_experts=spec.n_experts, num_experts_per_tok=spec.n_experts_used, sliding_window=oss.sliding_window,
        swiglu_limit=oss.swiglu_limit, swiglu_alpha=oss.swiglu_alpha, tie_word_embeddings=spec.tied_output,
        rope_parameters=rope_parameters(spec))
    assert cfg.layer_types == ["sliding_attention" if spec.window(i) else "full_attention"
                               for i in range(spec.n_layers)]
    cfg._attn_implementation = "eager"
    model = GptOssForCausalLM(cfg).float().eval()
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.out_norm, "lm_head.weight": w.output}

    def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [E, F, ...] x 2 -> [E, 2F, ...]
        return torch.stack([gate, up], dim=2).flatten(1, 2)

    for i, lw in enumerate(w.layers):
        p, b = f"model.layers.{i}.", lw.oss
        assert b is not None and lw.gate is not None and lw.up is not None and lw.down is not None
        assert b.gate_bias is not None and b.up_bias is not None and b.down_bias is not None
        sd |= {
            p + "input_layernorm.weight": lw.attn_norm, p + "post_attention_layernorm.weight": lw.ffn_norm,
            p + "self_attn.q_proj.weight": lw.wq, p + "self_attn.k_proj.weight": lw.wk,
            p + "self_attn.v_proj.weight": lw.wv, p + "self_attn.o_proj.weight": lw.wo,
            p + "self_attn.q_proj.bias": b.bq, p + "self_attn.k_proj.bias": b.bk,
            p + "self_attn.v_proj.bias": b.bv, p + "self_attn.o_proj.bias": b.bo, p + "self_attn.sinks": b.sinks,
            p + "mlp.router.weight": lw.router, p + "mlp.router.bias": b.router_bias,
            p + "mlp.experts.gate_up_proj": interleaved(lw.gate, lw.up).transpose(1, 2),
            p + "mlp.experts.gate_up_proj_bias": interleaved(b.gate_bias, b.up_bias),
            p + "mlp.experts.down_proj": lw.down.transpose(1, 2), p + "mlp.experts.down_proj_bias": b.down_bias,
        }
    return _loaded(model, sd)
