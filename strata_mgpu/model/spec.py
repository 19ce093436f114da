"""Model spec: the shapes of a model, read from GGUF metadata, and the tensors it must have.

One builder per `general.architecture`, registered in `SPEC_BUILDERS`. `validate_tensors` checks
every expected tensor's presence, shape and type against the spec, so that nothing later has to.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, Keys, RopeScalingType

from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.quant.formats import block_format

T = MODEL_TENSOR


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

    @property
    def mscale(self) -> float:
        """The factor on cos and sin (so on attention logits, squared): YaRN's 1 + 0.1 ln(factor) (1 where
        factor <= 1), times attn_factor."""
        yarn = self.kind == RopeScalingType.YARN and self.factor > 1
        return (1.0 + 0.1 * math.log(self.factor) if yarn else 1.0) * self.attn_factor

    def correction_range(self, head_dim: int, base: float) -> tuple[int, int]:
        """YaRN's frequencies [low, high] (indices of the head_dim / 2) over which the ramp runs, floored
        and ceiled as llama.cpp and transformers do."""
        def dim_of(turns: float) -> float:
            return head_dim * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

        return max(math.floor(dim_of(self.beta_fast)), 0), min(math.ceil(dim_of(self.beta_slow)), head_dim - 1)


NO_ROPE_SCALING = RopeScaling()
SCALE_LINEAR_KEY = "{arch}.rope.scale_linear"  # the factor's old name, which llama.cpp still reads


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and constants of a Mixture-of-Experts decoder. Every layer is a MoE layer."""

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

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape (torch order, [out, in]) the model must have."""
        D, E, F = self.hidden, self.n_experts, self.expert_ffn
        shapes: dict[str, tuple[int, ...]] = {
            tname(T.TOKEN_EMBD): (self.vocab_size, D),
            tname(T.OUTPUT_NORM): (D,),
        }
        if not self.tied_output:
            shapes[tname(T.OUTPUT)] = (self.vocab_size, D)
        for i in range(self.n_layers):
            shapes |= {
                tname(T.ATTN_NORM, i): (D,),
                tname(T.ATTN_Q, i): (self.q_dim, D),
                tname(T.ATTN_K, i): (self.kv_dim, D),
                tname(T.ATTN_V, i): (self.kv_dim, D),
                tname(T.ATTN_OUT, i): (D, self.q_dim),
                tname(T.ATTN_Q_NORM, i): (self.head_dim,),
                tname(T.ATTN_K_NORM, i): (self.head_dim,),
                tname(T.FFN_NORM, i): (D,),
                tname(T.FFN_GATE_INP, i): (E, D),
                tname(T.FFN_GATE_EXP, i): (E, F, D),
                tname(T.FFN_UP_EXP, i): (E, F, D),
                tname(T.FFN_DOWN_EXP, i): (E, D, F),
            }
        return shapes

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.expected_tensors().values())

    @property
    def n_active_params(self) -> int:
        """Parameters touched per token: all but the unused experts (and the embedding rows)."""
        per_expert = 3 * self.hidden * self.expert_ffn
        return self.n_params - self.n_layers * (self.n_experts - self.n_experts_used) * per_expert


def tname(kind: MODEL_TENSOR, layer: int | None = None) -> str:
    """GGUF tensor name from gguf.constants, e.g. tname(T.ATTN_Q, 3) == 'blk.3.attn_q.weight'."""
    base = TENSOR_NAMES[kind]
    return (base.format(bid=layer) if layer is not None else base) + ".weight"


EXPERT_TENSORS = (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP)


def _qwen3moe(f: GGUFFile, arch: str) -> ModelSpec:
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
    expected = spec.expected_tensors()
    for name, shape in expected.items():
        info = f.tensors.get(name)
        if info is None:
            raise GGUFError(f"{f.path}: missing tensor {name!r} (expected shape {list(shape)})")
        if info.shape != shape:
            raise GGUFError(f"{f.path}: tensor {name!r} has shape {list(info.shape)}, the spec says {list(shape)}")
        try:
            block_format(info.ggml_type)
        except ValueError as e:
            raise GGUFError(f"{f.path}: tensor {name!r}: {e}") from None
    extra = sorted(set(f.tensors) - set(expected))
    if extra:
        raise GGUFError(f"{f.path}: unexpected tensor {extra[0]!r} for architecture {spec.arch!r}"
                        + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
