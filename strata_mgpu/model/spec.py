"""Model spec: the shapes of a model, read from GGUF metadata, and the tensors it must have.

One builder per `general.architecture`, registered in `SPEC_BUILDERS`; `qwen3moe` is the first.
`validate_tensors` checks every expected tensor's presence, shape and type against the spec, so
that nothing later has to.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, Keys

from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.quant.formats import block_format

T = MODEL_TENSOR


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
    )
    _check_spec(f, spec)
    return spec


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
    """Build the spec from metadata; by default also check every tensor against it."""
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
