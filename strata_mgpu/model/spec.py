"""Model spec: the shapes of a model, read from GGUF metadata, and the tensors it must have.

One builder per `general.architecture`, registered in `SPEC_BUILDERS`: qwen3moe, and qwen35moe
(Qwen3.5/3.6-MoE: gated DeltaNet layers between gated full-attention ones, a shared expert beside
the routed ones) with qwen3next (Qwen3-Next: the same layers, its beta and alpha projections one
tensor, its value heads in transformers' grouped order), and gpt-oss (attention with biases and a
learned sink logit per head, sliding-window layers between full ones, experts with biases and a
clamped SwiGLU: `GptOssShape`; its ops are `model.gpt_oss`), and glm4moe (GLM-4.5: dense first
layers, q/k/v biases, a sigmoid router with a choice bias over expert groups: `SigmoidRouting`, its
ops `model.glm4moe`). `validate_tensors` checks every expected
tensor's presence, shape and type against the spec, so that nothing later has to.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from gguf.constants import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    ExpertGatingFuncType,
    Keys,
    RopeScalingType,
)

from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.model.glm4moe import SigmoidRouting
from strata_mgpu.quant.formats import block_format

T = MODEL_TENSOR
QWEN35MOE = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN35MOE]
QWEN3NEXT = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN3NEXT]
HYBRID_ARCHS = (QWEN35MOE, QWEN3NEXT)
GLM4MOE = MODEL_ARCH_NAMES[MODEL_ARCH.GLM4_MOE]
GPT_OSS = MODEL_ARCH_NAMES[MODEL_ARCH.GPT_OSS]


# `{arch}.rope.scaling.type` values served: what llama.cpp serves but LongRoPE
ROPE_SCALINGS = (RopeScalingType.NONE, RopeScalingType.LINEAR, RopeScalingType.YARN)


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies stretch past the context the model was trained at, from
    `{arch}.rope.scaling.*`, read as llama.cpp reads them. `linear` divides every frequency by
    `factor`; `yarn` divides only the slow ones (fewer than `beta_slow` turns over
    `original_context` positions), keeps the fast ones (more than `beta_fast`) and ramps between,
    and scales cos and sin by 1 + 0.1 ln(factor) (`mscale`)."""

    kind: RopeScalingType = RopeScalingType.NONE  # one of ROPE_SCALINGS
    factor: float = 1.0  # a scaled file's context is factor x original_context
    original_context: int = 0  # positions the model was trained at (YaRN's correction range); 0: unscaled
    attn_factor: float = 1.0  # `rope.scaling.attn_factor`: cos and sin multiplied by it too (llama.cpp)
    beta_fast: float = 32.0  # YaRN: frequencies turning more often than this over the original context keep theirs
    beta_slow: float = 1.0  # YaRN: fewer turns than this: divided by factor
    # YaRN: the correction range's ends floored and ceiled to whole frequencies (llama.cpp always does;
    # gpt-oss was trained without it: its config's `truncate: false`, which no GGUF key carries)
    truncate: bool = True

    @property
    def mscale(self) -> float:
        """The factor on cos and sin (so on attention logits, squared): YaRN's 1 + 0.1 ln(factor) (1 where
        factor <= 1), times attn_factor."""
        yarn = self.kind == RopeScalingType.YARN and self.factor > 1
        return (1.0 + 0.1 * math.log(self.factor) if yarn else 1.0) * self.attn_factor

    def correction_range(self, head_dim: int, base: float) -> tuple[float, float]:
        """YaRN's frequencies [low, high] (indices of the head_dim / 2) over which the ramp runs, floored
        and ceiled as llama.cpp and transformers do (as they are where not `truncate`)."""
        def dim_of(turns: float) -> float:
            return head_dim * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)


NO_ROPE_SCALING = RopeScaling()


@dataclass(frozen=True)
class DeltaNetShape:
    """A gated DeltaNet (linear attention) layer's shapes, from `{arch}.ssm.*` as llama.cpp reads
    them: state_size is the key head dim, group_count the key heads, time_step_rank the value heads,
    inner_size / time_step_rank the value head dim. `v_tiled`: the file orders value heads tiled over
    the key heads (value head j reads key head j % Hk: llama.cpp's converter reorders qwen35moe's
    so); else grouped (j // (Hv / Hk), transformers' order)."""

    conv_kernel: int  # K: the causal conv1d's width
    n_k_heads: int  # Hk
    n_v_heads: int  # Hv, a multiple of Hk
    k_head_dim: int  # Dk
    v_head_dim: int  # Dv
    v_tiled: bool = True

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v together."""
        return 2 * self.key_dim + self.value_dim

    def key_head_of(self) -> list[int]:
        """For each value head, the key (and query) head it reads."""
        r = self.n_v_heads // self.n_k_heads
        return [j % self.n_k_heads if self.v_tiled else j // r for j in range(self.n_v_heads)]


@dataclass(frozen=True)
class GptOssShape:
    """What gpt-oss adds to a MoE decoder, as llama.cpp reads it: `{arch}.attention.sliding_window` (W)
    and `.sliding_window_pattern` (default 2: layers 0, 2, 4, ... slide, as transformers' layer_types
    say); the experts' clamped SwiGLU, whose constants no key carries (llama.cpp's and transformers'
    defaults). Every attention layer has q, k, v and output biases and a sink logit per head; every
    MoE block a router bias and per-expert biases; no q/k norms."""

    sliding_window: int  # W: a sliding layer's query sees itself and the W - 1 positions before it
    swa_period: int = 2  # layer i slides where i % period < period - 1 (llama.cpp's set_swa_pattern); 1: none does
    swiglu_limit: float = 7.0  # gate clamped above, up clamped to [-limit, limit]
    swiglu_alpha: float = 1.702  # the gate's sigmoid gain

    def window(self, layer: int) -> int:
        """Layer `layer`'s window: W where it slides, 0 where it attends every position."""
        return self.sliding_window if layer % self.swa_period < self.swa_period - 1 else 0


SCALE_LINEAR_KEY = "{arch}.rope.scale_linear"  # the factor's old name, which llama.cpp still reads


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and constants of a Mixture-of-Experts decoder. Every layer is a MoE layer but the first
    `leading_dense` (glm4moe's), which have a plain SiLU-gated FFN of width `dense_ffn` instead."""

    arch: str
    n_layers: int
    hidden: int  # D
    n_heads: int  # H
    n_kv_heads: int  # Hkv
    head_dim: int  # Dh
    n_experts: int  # E
    n_experts_used: int  # A, experts per token
    expert_ffn: int  # F, one expert's hidden width
    vocab_size: int  # V
    context_length: int
    rope_base: float
    rms_eps: float
    tied_output: bool  # no output.weight: the head reuses token_embd
    norm_topk_prob: bool = True  # renormalize the top-k router weights to sum to 1
    name: str = ""
    rope_scaling: RopeScaling = NO_ROPE_SCALING
    rope_dim: int = 0  # dims of a head RoPE rotates (its first ones); 0: all of head_dim
    attn_output_gate: bool = False  # q_proj also gives a per-head gate: attention out * sigmoid(gate)
    shared_expert_ffn: int = 0  # the shared expert's hidden width; 0: no shared expert
    # every n-th layer (1-based) is full attention, the rest gated DeltaNet; 0: every layer attention
    full_attention_interval: int = 0
    delta: DeltaNetShape | None = None  # the DeltaNet layers' shapes, where there are such layers
    # multi-token prediction blocks after the n_layers (`{arch}.nextn_predict_layers`; llama.cpp's
    # converter writes Qwen3.5's one): in the file and checked, not run
    mtp_layers: int = 0
    # glm4moe's: leading dense layers, biased q/k/v, q/k norms optional, the sigmoid router; its shared
    # expert (shared_expert_ffn) is ungated
    leading_dense: int = 0
    dense_ffn: int = 0  # the dense layers' FFN width (`{arch}.feed_forward_length`)
    attn_bias: bool = False  # attn_q/k/v have a .bias
    qk_norm: bool = True  # attn_q_norm / attn_k_norm present
    sigmoid_routing: SigmoidRouting | None = None  # None: softmax, top-k (qwen3moe's)
    gpt_oss: GptOssShape | None = None  # sinks, sliding windows, biases, clamped SwiGLU (gpt-oss)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def q_proj_dim(self) -> int:
        """Rows of attn_q: the queries, and with an output gate each head's gate after its query."""
        return self.q_dim * (2 if self.attn_output_gate else 1)

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    def is_dense(self, layer: int) -> bool:
        """Layer `layer` has a dense FFN and no routed experts."""
        return layer < self.leading_dense

    @property
    def moe_layers(self) -> list[int]:
        """The layers with routed experts (every layer but the leading dense ones)."""
        return [i for i in range(self.n_layers) if not self.is_dense(i)]

    def is_linear(self, layer: int) -> bool:
        """Layer `layer` (of the whole model) is gated DeltaNet, not full attention."""
        return (self.full_attention_interval > 0 and layer < self.n_layers
                and (layer + 1) % self.full_attention_interval != 0)

    @property
    def hybrid(self) -> bool:
        return self.full_attention_interval > 0

    @property
    def fused_attention(self) -> bool:
        """The fused decode kernels serve its layers: every layer plain full attention, RoPE over every
        dim of a head, no output gate, no shared expert, no gpt-oss layers (else a forward takes the
        segment path)."""
        return not (self.hybrid or self.attn_output_gate or self.rotary_dim != self.head_dim
                    or self.shared_expert_ffn or self.reference_only)

    @property
    def reference_only(self) -> bool:
        """Only the CPU reference serves its layers (stages refuse it): gpt-oss's (sinks, sliding windows,
        biased clamped-SwiGLU experts, which the stages' kernels do not compute) and glm4moe's (dense
        first layers, attention biases, the sigmoid router). A hybrid model's DeltaNet layers are served
        by a stage (`check_layers_served`)."""
        return self.gpt_oss is not None or self.sigmoid_routing is not None

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (positions a query sees, itself included); 0: every position."""
        return self.gpt_oss.window(layer) if self.gpt_oss is not None else 0

    @property
    def ffn_norm_kind(self) -> MODEL_TENSOR:
        """The MoE block's input norm: qwen35moe's, qwen3next's, gpt-oss's and glm4moe's files call it
        post_attention_norm."""
        return T.ATTN_POST_NORM if self.arch in (*HYBRID_ARCHS, GPT_OSS, GLM4MOE) else T.FFN_NORM

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape (torch order, [out, in]) the model must have."""
        D, E, F = self.hidden, self.n_experts, self.expert_ffn
        shapes: dict[str, tuple[int, ...]] = {
            tname(T.TOKEN_EMBD): (self.vocab_size, D),
            tname(T.OUTPUT_NORM): (D,),
        }
        if not self.tied_output:
            shapes[tname(T.OUTPUT)] = (self.vocab_size, D)
        for i in range(self.n_layers + self.mtp_layers):
            shapes[tname(T.ATTN_NORM, i)] = (D,)
            if i >= self.n_layers:  # an MTP block: an attention layer and its own input projection
                shapes |= {tname(T.NEXTN_EH_PROJ, i): (D, 2 * D), tname(T.NEXTN_ENORM, i): (D,),
                           tname(T.NEXTN_HNORM, i): (D,), tname(T.NEXTN_SHARED_HEAD_NORM, i): (D,)}
            shapes |= self._delta_tensors(i) if self.is_linear(i) else self._attention_tensors(i)
            shapes[tname(self.ffn_norm_kind, i)] = (D,)
            if self.is_dense(i):
                Fd = self.dense_ffn
                shapes |= {tname(T.FFN_GATE, i): (Fd, D), tname(T.FFN_UP, i): (Fd, D), tname(T.FFN_DOWN, i): (D, Fd)}
                continue
            if self.sigmoid_routing is not None:
                shapes[tname(T.FFN_EXP_PROBS_B, i, ".bias")] = (E,)
            shapes |= {
                tname(T.FFN_GATE_INP, i): (E, D),
                tname(T.FFN_GATE_EXP, i): (E, F, D),
                tname(T.FFN_UP_EXP, i): (E, F, D),
                tname(T.FFN_DOWN_EXP, i): (E, D, F),
            }
            if self.gpt_oss is not None:
                shapes |= {tname(T.FFN_GATE_INP, i, ".bias"): (E,), tname(T.FFN_GATE_EXP, i, ".bias"): (E, F),
                           tname(T.FFN_UP_EXP, i, ".bias"): (E, F), tname(T.FFN_DOWN_EXP, i, ".bias"): (E, D)}
            if self.shared_expert_ffn:
                Fs = self.shared_expert_ffn
                if self.arch != GLM4MOE:  # glm4moe's shared expert has no gate
                    shapes[tname(T.FFN_GATE_INP_SHEXP, i)] = (D,)
                shapes |= {
                    tname(T.FFN_GATE_SHEXP, i): (Fs, D),
                    tname(T.FFN_UP_SHEXP, i): (Fs, D),
                    tname(T.FFN_DOWN_SHEXP, i): (D, Fs),
                }
        return shapes

    def optional_tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensors a file may have beside the expected ones: an MTP block's own embedding and head."""
        mtp = range(self.n_layers, self.n_layers + self.mtp_layers)
        return {tname(kind, i): (self.vocab_size, self.hidden) for i in mtp
                for kind in (T.NEXTN_EMBED_TOKENS, T.NEXTN_SHARED_HEAD_HEAD)}

    def _attention_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        D = self.hidden
        shapes: dict[str, tuple[int, ...]] = {
            tname(T.ATTN_Q, i): (self.q_proj_dim, D),
            tname(T.ATTN_K, i): (self.kv_dim, D),
            tname(T.ATTN_V, i): (self.kv_dim, D),
            tname(T.ATTN_OUT, i): (D, self.q_dim),
        }
        if self.gpt_oss is not None:  # biases and sinks rather than q/k norms
            return shapes | {tname(T.ATTN_Q, i, ".bias"): (self.q_dim,), tname(T.ATTN_K, i, ".bias"): (self.kv_dim,),
                             tname(T.ATTN_V, i, ".bias"): (self.kv_dim,), tname(T.ATTN_OUT, i, ".bias"): (D,),
                             tname(T.ATTN_SINKS, i): (self.n_heads,)}
        if self.qk_norm:
            shapes |= {tname(T.ATTN_Q_NORM, i): (self.head_dim,), tname(T.ATTN_K_NORM, i): (self.head_dim,)}
        if self.attn_bias:  # glm4moe's
            shapes |= {tname(T.ATTN_Q, i, ".bias"): (self.q_proj_dim,), tname(T.ATTN_K, i, ".bias"): (self.kv_dim,),
                       tname(T.ATTN_V, i, ".bias"): (self.kv_dim,)}
        return shapes

    def _delta_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        d, D = self.delta, self.hidden
        assert d is not None, "a hybrid spec has its DeltaNet shapes"
        rates = ({tname(T.SSM_BETA_ALPHA, i): (2 * d.n_v_heads, D)} if self.arch == QWEN3NEXT
                 else {tname(T.SSM_BETA, i): (d.n_v_heads, D), tname(T.SSM_ALPHA, i): (d.n_v_heads, D)})
        return rates | {
            tname(T.ATTN_QKV, i): (d.conv_dim, D),
            tname(T.ATTN_GATE, i): (d.value_dim, D),
            tname(T.SSM_CONV1D, i): (d.conv_dim, d.conv_kernel),
            tname(T.SSM_DT, i, ".bias"): (d.n_v_heads,),
            tname(T.SSM_A, i, ""): (d.n_v_heads,),
            tname(T.SSM_NORM, i): (d.v_head_dim,),
            tname(T.SSM_OUT, i): (D, d.value_dim),
        }

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.expected_tensors().values())

    @property
    def n_active_params(self) -> int:
        """Parameters touched per token: all but the unused experts and the MTP blocks (and the embedding
        rows)."""
        per_expert = 3 * self.hidden * self.expert_ffn
        mtp = sum(math.prod(s) for name, s in self.expected_tensors().items()
                  if name.startswith("blk.") and int(name.split(".")[1]) >= self.n_layers)
        return self.n_params - mtp - len(self.moe_layers) * (self.n_experts - self.n_experts_used) * per_expert

    @property
    def attention_layers(self) -> list[int]:
        """The full-attention layers, whose keys and values a sequence's KV cache holds."""
        return [i for i in range(self.n_layers) if not self.is_linear(i)]

    def linear_state_bytes(self, elem: int = 4, layers: range | None = None) -> int:
        """Bytes of one sequence's DeltaNet state, every linear layer (of `layers`, default all): conv
        [C, K - 1] and recurrent [Hv, Dk, Dv] (`elem` bytes a value)."""
        d = self.delta
        if d is None:
            return 0
        per_layer = d.conv_dim * (d.conv_kernel - 1) + d.n_v_heads * d.k_head_dim * d.v_head_dim
        return sum(self.is_linear(i) for i in (range(self.n_layers) if layers is None else layers)) * per_layer * elem


def tname(kind: MODEL_TENSOR, layer: int | None = None, suffix: str = ".weight") -> str:
    """GGUF tensor name from gguf.constants, e.g. tname(T.ATTN_Q, 3) == 'blk.3.attn_q.weight'
    (`suffix` '.bias' or '' for the tensors llama.cpp names so: ssm_dt.bias, ssm_a)."""
    base = TENSOR_NAMES[kind]
    return (base.format(bid=layer) if layer is not None else base) + suffix


EXPERT_TENSORS = (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP)


def _qwen3moe(f: GGUFFile, arch: str, check: bool = True) -> ModelSpec:
    L = Keys.LLM
    A = Keys.Attention

    def key(k: str) -> str:
        return k.format(arch=arch)

    n_heads = f.require(key(A.HEAD_COUNT), int)
    hidden = f.require(key(L.EMBEDDING_LENGTH), int)
    head_dim = f.get(key(A.KEY_LENGTH), hidden // max(n_heads, 1))
    tokens = f.get(Keys.Tokenizer.LIST)
    embd = f.tensors.get(tname(T.TOKEN_EMBD))
    vocab = f.get(key(L.VOCAB_SIZE)) or (embd.shape[0] if embd else len(tokens) if tokens is not None else 0)
    spec = ModelSpec(
        arch=arch,
        name=str(f.get(Keys.General.NAME, "")),
        n_layers=f.require(key(L.BLOCK_COUNT), int),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=f.require(key(A.HEAD_COUNT_KV), int),
        head_dim=head_dim,
        n_experts=f.require(key(L.EXPERT_COUNT), int),
        n_experts_used=f.require(key(L.EXPERT_USED_COUNT), int),
        expert_ffn=f.require(key(L.EXPERT_FEED_FORWARD_LENGTH), int),
        vocab_size=vocab,
        context_length=f.require(key(L.CONTEXT_LENGTH), int),
        rope_base=f.get(key(Keys.Rope.FREQ_BASE), 10000.0),
        rms_eps=f.require(key(A.LAYERNORM_RMS_EPS), float),
        tied_output=tname(T.OUTPUT) not in f.tensors,
        rope_scaling=rope_scaling_from_gguf(f, arch),
    )
    if check:
        _check_spec(f, spec)
    return spec


def _hybrid(f: GGUFFile, arch: str) -> ModelSpec:
    """Qwen3.5/3.6-MoE (qwen35moe) and Qwen3-Next (qwen3next) as llama.cpp's converter writes them:
    qwen3moe's keys, plus the DeltaNet layers' `ssm.*`, `full_attention_interval`, the partial
    RoPE's `rope.dimension_count` and the shared expert's width. Their attention always has the
    output gate; text positions make qwen35moe's sectioned RoPE (`rope.dimension_sections`) plain
    RoPE, every section rotated by the same position. What differs is in the tensors: qwen3next
    keeps beta and alpha as one `ssm_ba`, and its value heads grouped (the converter tiles qwen35moe's)."""
    L, S = Keys.LLM, Keys.SSM

    def key(k: str) -> str:
        return k.format(arch=arch)

    spec = _qwen3moe(f, arch, check=False)
    mtp = f.get(key(L.NEXTN_PREDICT_LAYERS), 0)
    if not (isinstance(mtp, int) and 0 <= mtp < spec.n_layers):
        raise GGUFError(f"{f.path}: metadata {key(L.NEXTN_PREDICT_LAYERS)!r} = {mtp!r} must be a whole number "
                        f"below the {spec.n_layers} blocks")
    n_v = f.require(key(S.TIME_STEP_RANK), int)
    inner = f.require(key(S.INNER_SIZE), int)
    delta = DeltaNetShape(conv_kernel=f.require(key(S.CONV_KERNEL), int), n_k_heads=f.require(key(S.GROUP_COUNT), int),
                          n_v_heads=n_v, k_head_dim=f.require(key(S.STATE_SIZE), int),
                          v_head_dim=inner // n_v if n_v > 0 else 0, v_tiled=arch == QWEN35MOE)
    spec = replace(spec, n_layers=spec.n_layers - mtp, mtp_layers=mtp, delta=delta, attn_output_gate=True,
                   rope_dim=f.get(key(Keys.Rope.DIMENSION_COUNT), spec.head_dim),
                   shared_expert_ffn=f.require(key(L.EXPERT_SHARED_FEED_FORWARD_LENGTH), int),
                   full_attention_interval=f.get(key(L.FULL_ATTENTION_INTERVAL), 4))
    _check_spec(f, spec)
    bad = next((f"{name} = {v!r} must be a positive integer" for name, v in
                (("DeltaNet conv kernel", delta.conv_kernel), ("DeltaNet key heads", delta.n_k_heads),
                 ("DeltaNet value heads", delta.n_v_heads), ("DeltaNet key head dim", delta.k_head_dim),
                 ("DeltaNet value head dim", delta.v_head_dim), ("shared expert width", spec.shared_expert_ffn),
                 ("full attention interval", spec.full_attention_interval))
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0), None)
    if bad is None and n_v % delta.n_k_heads:
        bad = f"{n_v} DeltaNet value heads are not a multiple of {delta.n_k_heads} key heads"
    if bad is None and inner != delta.value_dim:
        bad = f"metadata {key(S.INNER_SIZE)!r} = {inner} is not a multiple of {n_v} value heads"
    if bad is None and not (isinstance(spec.rope_dim, int) and 0 < spec.rope_dim <= spec.head_dim
                            and spec.rope_dim % 2 == 0):
        bad = f"RoPE dims {spec.rope_dim!r} must be even and within head dim {spec.head_dim}"
    if bad is not None:
        raise GGUFError(f"{f.path}: {bad}")
    return spec


def _glm4moe(f: GGUFFile, arch: str) -> ModelSpec:
    """GLM-4.5 / GLM-4.5-Air as llama.cpp's converter writes them and its loader reads them:
    qwen3moe's keys, plus `expert_shared_count` (required) shared experts of the expert width,
    `leading_dense_block_count` (none where absent) dense layers of `feed_forward_length`, sigmoid
    gating (absent or 0 reads as sigmoid) with `exp_probs_b`, the weights' `expert_weights_norm` (off
    where absent) and `expert_weights_scale` (absent or 0: none), the partial RoPE's
    `rope.dimension_count` (NeoX halves), the MTP blocks' `nextn_predict_layers` (counted in
    block_count). Biases on q, k and v and q/k norms where the file has them (GLM-4.5's and Air's
    biases; GLM-4.5's norms, not Air's). Groups: `expert_group_count` where written, else one."""
    L = Keys.LLM

    def key(k: str) -> str:
        return k.format(arch=arch)

    def whole(k: str, default: int | None = None) -> int:
        v = f.get(key(k), default) if default is not None else f.require(key(k), int)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise GGUFError(f"{f.path}: metadata {key(k)!r} = {v!r} must be a whole number")
        return v

    spec = _qwen3moe(f, arch, check=False)
    mtp, dense, shared = whole(L.NEXTN_PREDICT_LAYERS, 0), whole(L.LEADING_DENSE_BLOCK_COUNT, 0), \
        whole(L.EXPERT_SHARED_COUNT)
    gating = whole(L.EXPERT_GATING_FUNC, 0) or ExpertGatingFuncType.SIGMOID.value
    if gating != ExpertGatingFuncType.SIGMOID.value:
        raise GGUFError(f"{f.path}: metadata {key(L.EXPERT_GATING_FUNC)!r} = {gating} is not supported "
                        f"(glm4moe: {ExpertGatingFuncType.SIGMOID.value}, sigmoid)")
    if not mtp < spec.n_layers or not dense <= spec.n_layers - mtp:
        raise GGUFError(f"{f.path}: {mtp} MTP blocks and {dense} dense layers do not fit {spec.n_layers} blocks")
    norm_key, scale_key = key(L.EXPERT_WEIGHTS_NORM), key(L.EXPERT_WEIGHTS_SCALE)
    routing = SigmoidRouting(n_groups=whole(L.EXPERT_GROUP_COUNT, 1) or 1,
                             groups_used=whole(L.EXPERT_GROUP_USED_COUNT, 1) or 1,
                             normalize=f.require(norm_key, bool) if norm_key in f.metadata else False,
                             scale=(f.require(scale_key, float) if scale_key in f.metadata else 0.0) or 1.0)
    spec = replace(spec, n_layers=spec.n_layers - mtp, mtp_layers=mtp, leading_dense=dense,
                   dense_ffn=whole(L.FEED_FORWARD_LENGTH) if dense else 0,
                   shared_expert_ffn=shared * spec.expert_ffn, attn_bias=tname(T.ATTN_Q, 0, ".bias") in f.tensors,
                   qk_norm=tname(T.ATTN_Q_NORM, 0) in f.tensors, sigmoid_routing=routing,
                   rope_dim=f.get(key(Keys.Rope.DIMENSION_COUNT), spec.head_dim), norm_topk_prob=routing.normalize)
    _check_spec(f, spec)
    bad = None
    if routing.n_groups > spec.n_experts or spec.n_experts % routing.n_groups \
            or not routing.groups_used <= routing.n_groups:
        bad = (f"{routing.groups_used} of {routing.n_groups} expert groups do not divide {spec.n_experts} experts")
    elif not (routing.scale > 0 and math.isfinite(routing.scale)):
        bad = f"metadata {key(L.EXPERT_WEIGHTS_SCALE)!r} = {routing.scale!r} must be positive and finite"
    elif dense and spec.dense_ffn <= 0:
        bad = f"metadata {key(L.FEED_FORWARD_LENGTH)!r} = {spec.dense_ffn} must be positive with dense layers"
    elif not (isinstance(spec.rope_dim, int) and 0 < spec.rope_dim <= spec.head_dim and spec.rope_dim % 2 == 0):
        bad = f"RoPE dims {spec.rope_dim!r} must be even and within head dim {spec.head_dim}"
    if bad is not None:
        raise GGUFError(f"{f.path}: {bad}")
    return spec


def _gpt_oss(f: GGUFFile, arch: str) -> ModelSpec:
    """gpt-oss as llama.cpp's converter writes it: qwen3moe's keys, plus the sliding window (and, where
    given, its pattern as one period); YaRN's correction range untruncated (`RopeScaling.truncate`)."""
    A = Keys.Attention

    def key(k: str) -> str:
        return k.format(arch=arch)

    spec = _qwen3moe(f, arch, check=False)
    window = f.require(key(A.SLIDING_WINDOW), int)
    period = f.require(key(A.SLIDING_WINDOW_PATTERN), int) if key(A.SLIDING_WINDOW_PATTERN) in f.metadata else 2
    for name, v in ((A.SLIDING_WINDOW, window), (A.SLIDING_WINDOW_PATTERN, period)):
        if v <= 0:
            raise GGUFError(f"{f.path}: metadata {key(name)!r} = {v} must be positive")
    spec = replace(spec, gpt_oss=GptOssShape(sliding_window=window, swa_period=period),
                   rope_scaling=replace(spec.rope_scaling, truncate=False))
    _check_spec(f, spec)
    return spec


def rope_scaling_from_gguf(f: GGUFFile, arch: str) -> RopeScaling:
    """`{arch}.rope.scaling.*` as llama.cpp's `load_hparams` reads them: no type is linear; no factor,
    or 0, is 1; `none` scales nothing, but attn_factor still multiplies cos and sin; the original
    context defaults to the file's; the YaRN betas default to 32 and 1. An unknown type, or a value
    out of range, is refused in one line."""
    R = Keys.Rope

    def key(k: str) -> str:
        return k.format(arch=arch)

    def number(k: str, default: float, zero_ok: bool = False) -> float:
        if key(k) not in f.metadata:
            return default
        v = f.require(key(k), float)
        if not ((v > 0 or (zero_ok and v == 0)) and math.isfinite(v)):
            raise GGUFError(f"{f.path}: metadata {key(k)!r} = {v!r} must be positive and finite")
        return v

    name = f.require(key(R.SCALING_TYPE), str) if key(R.SCALING_TYPE) in f.metadata else RopeScalingType.LINEAR.value
    kind = next((k for k in ROPE_SCALINGS if k.value == name), None)
    if kind is None:
        raise GGUFError(f"{f.path}: metadata {key(R.SCALING_TYPE)!r} = {name!r} is not supported "
                        f"(supported: {', '.join(k.value for k in ROPE_SCALINGS)})")
    factor_key = R.SCALING_FACTOR if key(R.SCALING_FACTOR) in f.metadata else SCALE_LINEAR_KEY
    factor = number(factor_key, 0.0, zero_ok=True) or 1.0
    attn_factor = number(R.SCALING_ATTN_FACTOR, 1.0)
    if kind == RopeScalingType.NONE or factor == 1.0:
        return RopeScaling(attn_factor=attn_factor)
    original = f.require(key(R.SCALING_ORIG_CTX_LEN), int) if key(R.SCALING_ORIG_CTX_LEN) in f.metadata \
        else f.require(key(Keys.LLM.CONTEXT_LENGTH), int)
    if original <= 0:
        raise GGUFError(f"{f.path}: metadata {key(R.SCALING_ORIG_CTX_LEN)!r} = {original} must be positive")
    return RopeScaling(kind=kind, factor=factor, original_context=original, attn_factor=attn_factor,
                       beta_fast=number(R.SCALING_YARN_BETA_FAST, 32.0),
                       beta_slow=number(R.SCALING_YARN_BETA_SLOW, 1.0))


def _check_spec(f: GGUFFile, s: ModelSpec) -> None:
    def bad(what: str) -> GGUFError:
        return GGUFError(f"{f.path}: {what}")

    for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "n_experts", "n_experts_used",
                  "expert_ffn", "vocab_size", "context_length"):
        v = getattr(s, field)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise bad(f"model {field} = {v!r} must be a positive integer")
    if s.n_heads % s.n_kv_heads:
        raise bad(f"{s.n_heads} attention heads are not a multiple of {s.n_kv_heads} KV heads")
    if s.head_dim % 2:
        raise bad(f"head dim {s.head_dim} must be even for RoPE")
    if s.n_experts_used > s.n_experts:
        raise bad(f"{s.n_experts_used} experts used per token, but only {s.n_experts} experts")
    if not (s.rms_eps > 0 and math.isfinite(s.rms_eps)):
        raise bad(f"RMS norm epsilon {s.rms_eps!r} must be positive and finite")
    if not (isinstance(s.rope_base, float | int) and s.rope_base > 0 and math.isfinite(s.rope_base)):
        raise bad(f"RoPE base {s.rope_base!r} must be positive and finite")


SPEC_BUILDERS: dict[str, Callable[[GGUFFile, str], ModelSpec]] = {
    MODEL_ARCH_NAMES[MODEL_ARCH.QWEN3MOE]: _qwen3moe,
    QWEN35MOE: _hybrid,
    QWEN3NEXT: _hybrid,
    GLM4MOE: _glm4moe,
    GPT_OSS: _gpt_oss,
}


def spec_from_gguf(f: GGUFFile, *, check_tensors: bool = True) -> ModelSpec:
    arch = f.require(Keys.General.ARCHITECTURE, str)
    builder = SPEC_BUILDERS.get(arch)
    if builder is None:
        raise GGUFError(f"{f.path}: architecture {arch!r} is not supported (supported: "
                        f"{', '.join(SPEC_BUILDERS)})")
    spec = builder(f, arch)
    if check_tensors:
        validate_tensors(f, spec)
    return spec


def validate_tensors(f: GGUFFile, spec: ModelSpec) -> None:
    """Every expected tensor exists with the spec's shape and a supported type; nothing else is there."""
    expected, optional = spec.expected_tensors(), spec.optional_tensors()
    present = {name: shape for name, shape in optional.items() if name in f.tensors}
    for name, shape in {**expected, **present}.items():
        info = f.tensors.get(name)
        if info is None:
            raise GGUFError(f"{f.path}: missing tensor {name!r} (expected shape {list(shape)})")
        if _unpadded(info.shape) != _unpadded(shape):  # ggml pads ne with 1s: [1, D] is [D]
            raise GGUFError(f"{f.path}: tensor {name!r} has shape {list(info.shape)}, the spec says {list(shape)}")
        try:
            block_format(info.ggml_type)
        except ValueError as e:
            raise GGUFError(f"{f.path}: tensor {name!r}: {e}") from None
    extra = sorted(set(f.tensors) - set(expected) - set(optional))
    if extra:
        raise GGUFError(f"{f.path}: unexpected tensor {extra[0]!r} for architecture {spec.arch!r}"
                        + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def _unpadded(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape less its leading unit dims (ggml's trailing ones in ne)."""
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return shape[i:]
