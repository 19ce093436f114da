"""Synthetic qwen3moe / qwen35moe / gpt-oss GGUF writer: real, valid quantized blocks of any supported
type. A qwen35moe file is laid out as llama.cpp's converter writes one (tensor names, metadata keys,
norm weights around 1, ssm_a = -exp(A_log) < 0, value heads in its tiled order); a gpt-oss file too
(biases and sinks F32 around 0, the experts MXFP4 by default, as the released files hold them).

Float tensors are Gaussian; quantized tensors are random bytes (any bit pattern is a valid quant;
the ternary types are drawn as ternary digits) whose scale words are then set so the dequantized
weights have the wanted spread. Dequantization is linear in the scale words, so a one-off
calibration per format tells which values to write. Random codes are not zero-mean in most
formats (Q4_0's q - 8 averages -0.5), so every block's scale words also get a random sign.
Everything derives from `--seed` and the tensor's name: same seed, same file.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf import quants as gguf_quants
from gguf.constants import TENSOR_NAMES, ExpertGatingFuncType, GGMLQuantizationType, LlamaFileType, RopeScalingType

from strata_mgpu.model.glm4moe import SigmoidRouting
from strata_mgpu.model.spec import (
    EXPERT_TENSORS,
    GLM4MOE,
    GPT_OSS,
    NO_ROPE_SCALING,
    QWEN3NEXT,
    QWEN35MOE,
    ROPE_SCALINGS,
    DeltaNetShape,
    GptOssShape,
    ModelSpec,
    RopeScaling,
    T,
)
from strata_mgpu.model.vocab import CHAT_TEMPLATE, DEFAULT_FAMILY, build_vocab, family_of_template, write_vocab
from strata_mgpu.quant.formats import BlockFormat, block_format, parse_type, set_f16_scale_bits

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Preset:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    vocab_size: int
    context_length: int
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    tied_output: bool = False
    # qwen35moe's (all left as they are: qwen3moe)
    delta: DeltaNetShape | None = None
    arch: str = QWEN35MOE  # the hybrid's: qwen35moe, or qwen3next
    mtp_layers: int = 0  # MTP blocks written after the layers (checked by the reader, not run)
    full_attention_interval: int = 0
    rope_dim: int = 0
    shared_expert_ffn: int = 0
    # gpt-oss's (its arch then gpt-oss): sliding windows, sinks, biases; its YaRN and MXFP4 experts
    gpt_oss: GptOssShape | None = None
    rope_scaling: RopeScaling = NO_ROPE_SCALING
    expert_type: Q = Q.Q4_K  # the experts' gate/up type where --expert-type gives none
    # the chat template written where none is given: one shipped with the package (data/templates/NAME.jinja,
    # its vocabulary family the one it writes), else the synthetic ChatML one (qwen's family)
    template: str | None = None
    # glm4moe's (arch GLM4MOE): leading dense layers of dense_ffn, its router, q/k norms or not
    leading_dense: int = 0
    dense_ffn: int = 0
    sigmoid_routing: SigmoidRouting | None = None
    qk_norm: bool = True

    def spec(self, name: str) -> ModelSpec:
        hybrid, glm = self.delta is not None, self.arch == GLM4MOE
        arch = GPT_OSS if self.gpt_oss is not None else self.arch if hybrid or glm else "qwen3moe"
        return ModelSpec(arch=arch, name=name, n_layers=self.n_layers,
                         hidden=self.hidden, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                         n_experts=self.n_experts, n_experts_used=self.n_experts_used, expert_ffn=self.expert_ffn,
                         vocab_size=self.vocab_size, context_length=self.context_length,
                         rope_base=self.rope_base, rms_eps=self.rms_eps, tied_output=self.tied_output,
                         delta=self.delta, full_attention_interval=self.full_attention_interval,
                         rope_dim=self.rope_dim, shared_expert_ffn=self.shared_expert_ffn, attn_output_gate=hybrid,
                         mtp_layers=self.mtp_layers, gpt_oss=self.gpt_oss, rope_scaling=self.rope_scaling,
                         leading_dense=self.leading_dense, dense_ffn=self.dense_ffn, attn_bias=glm,
                         qk_norm=self.qk_norm, sigmoid_routing=self.sigmoid_routing,
                         norm_topk_prob=self.sigmoid_routing.normalize if self.sigmoid_routing else True)


# K-quants need rows (hidden, expert_ffn) in whole 256-weight blocks, hence the widths.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, n_experts_used=2,
                   expert_ffn=256, vocab_size=2048, context_length=4096),
    "small": Preset(n_layers=8, hidden=512, n_heads=8, n_kv_heads=4, head_dim=64, n_experts=32, n_experts_used=4,
                    expert_ffn=512, vocab_size=8192, context_length=8192),
    # Qwen3-30B-A3B's shapes.
    "30b-a3b": Preset(n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128,
                      n_experts_used=8, expert_ffn=768, vocab_size=151936, context_length=40960),
    # Qwen3-235B-A22B's shapes (its config.json: every layer MoE, so its dense intermediate 12,288 is
    # only the feed_forward_length written, 8 x 1,536). 94 layers of Q4_K/Q6_K experts are ~147 GB:
    # `--layers N` writes its first N (24: ~38 GB).
    "235b-a22b": Preset(n_layers=94, hidden=4096, n_heads=64, n_kv_heads=4, head_dim=128, n_experts=128,
                        n_experts_used=8, expert_ffn=1536, vocab_size=151936, context_length=40960),
    # qwen35moe, both layer kinds in turn (layers 0 and 2 gated DeltaNet, 1 and 3 full attention),
    # twice as many value heads as key heads (as Qwen3.5's), a quarter of each head rotated, and an
    # MTP block after them (blk.4), as the converter writes Qwen3.5's
    "tiny-hybrid": Preset(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, n_experts_used=2,
                          expert_ffn=256, vocab_size=2048, context_length=4096, delta=DeltaNetShape(
                              conv_kernel=4, n_k_heads=2, n_v_heads=4, k_head_dim=64, v_head_dim=64),
                          full_attention_interval=2, rope_dim=16, shared_expert_ffn=256, mtp_layers=1),
    # the same as qwen3next, as llama.cpp's converter writes Qwen3-Next (ssm_ba; value heads grouped)
    "tiny-next": Preset(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, n_experts_used=2,
                        expert_ffn=256, vocab_size=2048, context_length=4096, arch=QWEN3NEXT, delta=DeltaNetShape(
                            conv_kernel=4, n_k_heads=2, n_v_heads=4, k_head_dim=64, v_head_dim=64, v_tiled=False),
                        full_attention_interval=2, rope_dim=16, shared_expert_ffn=256),
    # Qwen3.5-35B-A3B's text shapes (its config.json: 40 layers, 3 DeltaNet then 1 attention, 16 QK
    # and 32 V linear heads of 128, 16 query and 2 KV heads of 256, 64 of them rotated, 256
    # experts of 512, 8 used, a shared expert of 512, rope_theta 1e7, 262,144 positions; its MTP block)
    "35b-a3b-hybrid": Preset(n_layers=40, hidden=2048, n_heads=16, n_kv_heads=2, head_dim=256, n_experts=256,
                             n_experts_used=8, expert_ffn=512, vocab_size=248320, context_length=262144,
                             rope_base=10_000_000.0, delta=DeltaNetShape(
                                 conv_kernel=4, n_k_heads=16, n_v_heads=32, k_head_dim=128, v_head_dim=128),
                             full_attention_interval=4, rope_dim=64, shared_expert_ffn=512, mtp_layers=1),
    # glm4moe: layer 0 dense, 1-3 MoE with an ungated shared expert, half of each head rotated, an MTP
    # block (blk.4); 2 groups of 4 experts, one used, to reach the grouped choice; GLM-4.5's scale of
    # the routed weights (routed_scaling_factor 2.5; Air's is 1.0, which would leave the key untested);
    # both glm4moe presets carry GLM-4.5's chat template and so its vocabulary family
    "tiny-glm4moe": Preset(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8,
                           n_experts_used=2, expert_ffn=256, vocab_size=2048, context_length=4096, arch=GLM4MOE,
                           rms_eps=1e-5, rope_dim=32, shared_expert_ffn=256, mtp_layers=1, leading_dense=1,
                           dense_ffn=512, sigmoid_routing=SigmoidRouting(n_groups=2, groups_used=1, scale=2.5),
                           qk_norm=False, template="glm-4.5"),
    # GLM-4.5-Air's shapes, checked against its config.json (huggingface.co/zai-org/GLM-4.5-Air; the
    # same values in its fine-tune PrimeIntellect/INTELLECT-3's): hidden 4096, 46 layers, the first
    # dense (first_k_dense_replace 1) of intermediate_size 10,944, 96 query and 8 KV heads of head_dim
    # 128, half rotated (partial_rotary_factor 0.5), rope_theta 1e6, 128 routed experts of 1,408, 8 used,
    # n_shared_experts 1, n_group 1 / topk_group 1, routed_scaling_factor 1.0, norm_topk_prob true,
    # attention_bias true, use_qk_norm false, rms_norm_eps 1e-5, 131,072 positions, vocab 151,552, untied
    # head; and against llama.cpp's Glm4MoeModel converter (conversion/glm.py) and glm4moe loader
    # (src/models/glm4-moe.cpp): block_count 47 with num_nextn_predict_layers 1 (its MTP block, blk.46,
    # a MoE layer with nextn.* tensors), rope.dimension_count 64, sigmoid expert_gating_func
    "glm-4.5-air": Preset(n_layers=46, hidden=4096, n_heads=96, n_kv_heads=8, head_dim=128, n_experts=128,
                          n_experts_used=8, expert_ffn=1408, vocab_size=151552, context_length=131072, arch=GLM4MOE,
                          rms_eps=1e-5, rope_dim=64, shared_expert_ffn=1408, mtp_layers=1, leading_dense=1,
                          dense_ffn=10944, sigmoid_routing=SigmoidRouting(), qk_norm=False, template="glm-4.5"),
    # gpt-oss, both layer kinds in turn (0 and 2 slide over 32 positions, 1 and 3 attend all), more
    # query dims than hidden (as gpt-oss's 64 x 64 over 2,880), YaRN x16 untruncated, MXFP4 experts
    "tiny-gpt-oss": Preset(n_layers=4, hidden=256, n_heads=6, n_kv_heads=2, head_dim=64, n_experts=8,
                           n_experts_used=4, expert_ffn=256, vocab_size=2048, context_length=4096,
                           rope_base=150_000.0, rms_eps=1e-5, gpt_oss=GptOssShape(sliding_window=32),
                           rope_scaling=RopeScaling(kind=RopeScalingType.YARN, factor=16.0, original_context=256,
                                                    truncate=False), expert_type=Q.MXFP4, template="gpt-oss"),
    # openai/gpt-oss-20b's shapes (its config.json: 24 layers of 2,880, 64 query and 8 KV heads of 64,
    # 32 experts of 2,880, 4 used, vocab 201,088, rope_theta 150,000, YaRN x32 over 4,096 positions,
    # window 128, rms_norm_eps 1e-5); MXFP4 experts, as released: ~12 GB
    "gpt-oss-20b": Preset(n_layers=24, hidden=2880, n_heads=64, n_kv_heads=8, head_dim=64, n_experts=32,
                          n_experts_used=4, expert_ffn=2880, vocab_size=201088, context_length=131072,
                          rope_base=150_000.0, rms_eps=1e-5, gpt_oss=GptOssShape(sliding_window=128),
                          rope_scaling=RopeScaling(kind=RopeScalingType.YARN, factor=32.0, original_context=4096,
                                                   truncate=False), expert_type=Q.MXFP4, template="gpt-oss"),
    # openai/gpt-oss-120b's: the same but 36 layers of 128 experts (~63 GB; `--layers N` for a cut)
    "gpt-oss-120b": Preset(n_layers=36, hidden=2880, n_heads=64, n_kv_heads=8, head_dim=64, n_experts=128,
                           n_experts_used=4, expert_ffn=2880, vocab_size=201088, context_length=131072,
                           rope_base=150_000.0, rms_eps=1e-5, gpt_oss=GptOssShape(sliding_window=128),
                           rope_scaling=RopeScaling(kind=RopeScalingType.YARN, factor=32.0, original_context=4096,
                                                    truncate=False), expert_type=Q.MXFP4, template="gpt-oss"),
}


def preset_template(preset_name: str) -> str:
    """The chat template a preset's file carries where none is given (`Preset.template`)."""
    name = PRESETS[preset_name].template
    if name is None:
        return CHAT_TEMPLATE
    return resources.files("strata_mgpu").joinpath(f"data/templates/{name}.jinja").read_text(encoding="utf-8")


def preset_spec(preset_name: str, layers: int | None = None, rope: RopeScaling = NO_ROPE_SCALING) -> ModelSpec:
    """The preset's spec cut to its first `layers` layers (None: all), its RoPE scaled by `rope`."""
    preset = PRESETS[preset_name]
    spec = preset.spec(f"strata-synthetic-{preset_name}")
    if layers is not None:
        if not 1 <= layers <= preset.n_layers:
            raise ValueError(f"--layers {layers}: {preset_name} has 1 to {preset.n_layers} layers")
        spec = replace(spec, n_layers=layers, leading_dense=min(spec.leading_dense, layers))
    if rope.kind != RopeScalingType.NONE:
        if spec.gpt_oss is not None:  # as the reader takes a gpt-oss file's YaRN
            rope = replace(rope, truncate=False)
        spec = replace(spec, rope_scaling=rope, context_length=round(rope.factor * rope.original_context))
    return spec


def rope_option(text: str, context: int) -> RopeScaling:
    """gen-model's --rope-scaling: 'none', 'linear:FACTOR[:ORIGINAL]' or 'yarn:FACTOR[:ORIGINAL]'
    (ORIGINAL: the context trained at, default `context`), e.g. 'yarn:4:32768'."""
    kind_name, *rest = text.strip().lower().split(":")
    kinds = {k.value: k for k in ROPE_SCALINGS}
    if kind_name not in kinds or len(rest) > 2 or (kind_name == RopeScalingType.NONE.value) != (not rest):
        raise ValueError(f"--rope-scaling {text!r}: give none, linear:FACTOR[:ORIGINAL] or yarn:FACTOR[:ORIGINAL]")
    if not rest:
        return NO_ROPE_SCALING
    try:
        factor, original = float(rest[0]), int(rest[1]) if len(rest) > 1 else context
    except ValueError:
        raise ValueError(f"--rope-scaling {text!r}: FACTOR is a number, ORIGINAL a whole number of tokens") from None
    if not (factor > 1 and math.isfinite(factor)) or original < 1:
        raise ValueError(f"--rope-scaling {text!r}: FACTOR must be above 1, ORIGINAL at least 1")
    return RopeScaling(kind=kinds[kind_name], factor=factor, original_context=original)


def mix_option(text: str, n_layers: int) -> dict[int, tuple[Q, Q]]:
    """gen-model's --mix: experts' types by layer range, e.g. '0-3:Q6_K,4-:Q4_K' or
    '0-1:Q8_0/Q8_0,2-:Q4_K/Q6_K' (GATE_UP[/DOWN]; down by default DEFAULT_DOWN). Layers no range
    names keep --expert-type/--down-type. -> layer -> (gate/up type, down type)."""
    types: dict[int, tuple[Q, Q]] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:(-)(\d*))?:(\w+)(?:/(\w+))?", item)
        if not m:
            raise ValueError(f"--mix item {item!r}: give FIRST[-[LAST]]:GATE_UP[/DOWN], e.g. 0-3:Q6_K")
        first = int(m[1])
        last = first if not m[2] else int(m[3]) if m[3] else n_layers - 1
        if not first <= last < n_layers:
            raise ValueError(f"--mix item {item!r}: layers {first}-{last} are not within the model's 0-{n_layers - 1}")
        gate = parse_type(m[4])
        down = parse_type(m[5]) if m[5] else DEFAULT_DOWN.get(gate, gate)
        for i in range(first, last + 1):
            if i in types:
                raise ValueError(f"--mix item {item!r}: layer {i} is named twice")
            types[i] = (gate, down)
    return types


# gate/up type -> the down type Q4_K_M-style files pair with it.
DEFAULT_DOWN = {Q.Q4_K: Q.Q6_K, Q.Q5_K: Q.Q6_K, Q.Q4_0: Q.Q8_0}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: GGMLQuantizationType
    std: float  # spread of the weights
    mean: float = 0.0  # norm weights sit around 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape[:-1]) * block_format(self.ggml_type).row_bytes(self.shape[-1])


def plan_tensors(spec: ModelSpec, expert_type: Q, down_type: Q, dense_type: Q,
                 mix: dict[int, tuple[Q, Q]] | None = None) -> list[TensorPlan]:
    """Every tensor of the model with its type and spread, in file order. `mix`: as `mix_option` gives it."""
    shapes = spec.expected_tensors()
    plans = []
    expert_kinds = {TENSOR_NAMES[k].split(".")[-1] for k in EXPERT_TENSORS}
    for name, shape in shapes.items():
        parts = name.split(".")
        kind = parts[2] if parts[0] == "blk" else parts[0]  # 'blk.3.attn_q.weight' -> 'attn_q'
        std = 1.0 / math.sqrt(shape[-1])  # unit-variance outputs for unit-variance inputs
        if kind == _kind(T.ATTN_SINKS) or (name.endswith(".bias") and kind != _kind(T.SSM_DT)):
            # gpt-oss's sinks and biases; glm4moe's q/k/v biases and its router's choice bias
            plans.append(TensorPlan(name, shape, Q.F32, std=0.5 if kind == _kind(T.ATTN_SINKS) else 0.1))
        elif kind == _kind(T.SSM_A):  # -exp(A_log): every value head's decay rate negative
            plans.append(TensorPlan(name, shape, Q.F32, std=0.1, mean=-1.0))
        elif kind in (_kind(T.FFN_GATE_INP_SHEXP), _kind(T.SSM_CONV1D)):  # a dot with h; K-wide rows: F32
            plans.append(TensorPlan(name, shape, Q.F32, std=std))
        elif len(shape) == 1:  # RMSNorm weights, ssm_dt's bias
            plans.append(TensorPlan(name, shape, Q.F32, std=0.05, mean=1.0))
        elif kind == TENSOR_NAMES[T.FFN_GATE_INP].split(".")[-1]:  # router: F32, as llama.cpp keeps it
            plans.append(TensorPlan(name, shape, Q.F32, std=std))
        elif kind == TENSOR_NAMES[T.TOKEN_EMBD]:
            plans.append(TensorPlan(name, shape, dense_type, std=1.0))
        elif kind in expert_kinds:  # 'blk.3.ffn_down_exps.weight': layer 3's
            gate_up, down = (mix or {}).get(int(name.split(".")[1]), (expert_type, down_type))
            is_down = kind == TENSOR_NAMES[T.FFN_DOWN_EXP].split(".")[-1]
            plans.append(TensorPlan(name, shape, down if is_down else gate_up, std=std))
        else:
            plans.append(TensorPlan(name, shape, dense_type, std=std))
    for p in plans:
        fmt = block_format(p.ggml_type)
        if p.shape[-1] % fmt.block_size:
            raise ValueError(f"{p.name}: rows of {p.shape[-1]} do not fit {fmt.name} blocks of {fmt.block_size}")
    return plans


def _kind(t: T) -> str:
    return TENSOR_NAMES[t].split(".")[-1]


@cache
def _calibration(ggml_type: Q) -> tuple[float, float]:
    """(ratio, unit_std) for a quantized format: with its scale words set to (c, ratio*c, ...) the
    dequantized weights of random blocks have mean ~0 and std c*unit_std."""
    fmt = block_format(ggml_type)
    rng = np.random.default_rng(1234)
    blocks = _code_blocks(ggml_type, 4096, rng)

    def dequant_with(values: tuple[float, ...]) -> np.ndarray:
        b = blocks.copy()
        _set_scales(fmt, b, [np.full(len(b), v) for v in values])
        return gguf_quants.dequantize(b.reshape(1, -1), ggml_type).astype(np.float64)

    if fmt.e8m0_fields:
        return 0.0, float(dequant_with((1.0,)).std())
    if fmt.f16_scales == 1:
        return 0.0, float(dequant_with((1.0,)).std())
    mean_d = dequant_with((1.0, 0.0)).mean()
    mean_m = dequant_with((0.0, 1.0)).mean()
    ratio = -mean_d / mean_m
    return float(ratio), float(dequant_with((1.0, ratio)).std())


def _code_blocks(ggml_type: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """[N, type_size] uint8: random valid blocks, scales still to be set (the ternary types drawn as
    digits -1, 0, 1, as ggml's quantizer writes them)."""
    fmt = block_format(ggml_type)
    if ggml_type == Q.TQ2_0:  # [qs:64][d:f16]: 4 digits a byte, 2 bits each
        digits = rng.integers(0, 3, size=(n_blocks, 64, 4), dtype=np.uint8)
        blocks = np.zeros((n_blocks, fmt.type_size), dtype=np.uint8)
        blocks[:, :64] = (digits << np.arange(0, 8, 2, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)
        return blocks
    if ggml_type == Q.TQ1_0:  # [qs:48][qh:4][d:f16]: 5 digits a byte as the base-3 fraction v / 243 (qh: 4, the 5th 0)
        v = rng.integers(0, 243, size=(n_blocks, 52))
        v[:, 48:] = rng.integers(0, 81, size=(n_blocks, 4)) * 3
        blocks = np.zeros((n_blocks, fmt.type_size), dtype=np.uint8)
        blocks[:, :52] = (v * 256 + 242) // 243  # ceil(v * 256 / 243), as ggml's quantize_row_tq1_0
        return blocks
    return rng.integers(0, 256, size=(n_blocks, fmt.type_size), dtype=np.uint8)


def _set_scales(fmt: BlockFormat, blocks: np.ndarray, values: list[np.ndarray]) -> None:
    if fmt.f16_scales:
        halves = [v.astype(np.float16).view(np.uint16) for v in values[:fmt.f16_scales]]
        set_f16_scale_bits(fmt, blocks, np.stack(halves, axis=1))
    for at in fmt.e8m0_fields:  # 2^(e-127): round the wanted scale to a power of two
        e = np.clip(np.round(np.log2(np.maximum(values[0], 1e-30))) + 127, 1, 254)
        blocks[:, at] = e.astype(np.uint8)


def make_tensor(plan: TensorPlan, seed: int) -> np.ndarray:
    """The bytes of one tensor, [..., row_bytes] uint8 (float types as their own dtype)."""
    rng = np.random.default_rng([seed, zlib.crc32(plan.name.encode())])
    t = plan.ggml_type
    if t in (Q.F32, Q.F16, Q.BF16):
        w = rng.standard_normal(plan.shape, dtype=np.float32) * np.float32(plan.std) + np.float32(plan.mean)
        if t == Q.F32:
            return w
        if t == Q.F16:
            return w.astype(np.float16)
        bits = w.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8).reshape(
            *plan.shape[:-1], plan.shape[-1] * 2)  # round to nearest even bf16
    fmt = block_format(t)
    n_blocks = math.prod(plan.shape) // fmt.block_size
    blocks = _code_blocks(t, n_blocks, rng)
    ratio, unit = _calibration(t)
    c = plan.std / unit * rng.uniform(0.5, 1.5, size=n_blocks)  # per-block scale jitter
    if fmt.f16_scales:  # fp16 scales: a random sign a block (see the module docstring)
        c *= rng.choice(np.array([-1.0, 1.0]), size=n_blocks)
    _set_scales(fmt, blocks, [c, ratio * c])
    return blocks.reshape(*plan.shape[:-1], fmt.row_bytes(plan.shape[-1]))


# Tensors made ahead of the one being written, at most this many bytes of them (and at least one)
AHEAD_BYTES = 2 << 30


def tensors_in_order(plans: list[TensorPlan], seed: int, workers: int) -> Iterator[np.ndarray]:
    """`make_tensor` of each plan, in order; with workers > 1 made on a thread pool ahead of the
    writer (numpy's fills run without the GIL). The file is the same whatever `workers` is."""
    if workers <= 1:
        yield from (make_tensor(p, seed) for p in plans)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="gen-model") as pool:
        ahead: deque[tuple[Future, int]] = deque()
        pending = 0
        rest = iter(plans)
        for p in rest:
            while ahead and (pending + p.nbytes > AHEAD_BYTES or len(ahead) >= 2 * workers):
                done, nbytes = ahead.popleft()
                pending -= nbytes
                yield done.result()
            ahead.append((pool.submit(make_tensor, p, seed), p.nbytes))
            pending += p.nbytes
        while ahead:
            yield ahead.popleft()[0].result()


# A file is labelled by its experts' gate/up type, as llama.cpp labels its quantizations (the
# experts are nearly all of a MoE's bytes); K-quants say whether down is of a larger type (_M).
_FILE_TYPES = {
    Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16, Q.BF16: LlamaFileType.MOSTLY_BF16,
    Q.Q4_0: LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: LlamaFileType.MOSTLY_Q4_1, Q.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    Q.Q5_1: LlamaFileType.MOSTLY_Q5_1, Q.Q8_0: LlamaFileType.MOSTLY_Q8_0, Q.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    Q.Q6_K: LlamaFileType.MOSTLY_Q6_K, Q.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL,
    Q.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS, Q.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
    Q.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS, Q.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS,
    Q.IQ2_S: LlamaFileType.MOSTLY_IQ2_S, Q.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS, Q.IQ3_S: LlamaFileType.MOSTLY_IQ3_S,
    Q.IQ1_S: LlamaFileType.MOSTLY_IQ1_S, Q.IQ1_M: LlamaFileType.MOSTLY_IQ1_M, Q.TQ1_0: LlamaFileType.MOSTLY_TQ1_0,
    Q.TQ2_0: LlamaFileType.MOSTLY_TQ2_0,
}
_K_SIZES = {  # gate/up type -> (file type with down alike, with down of a larger type)
    Q.Q3_K: (LlamaFileType.MOSTLY_Q3_K_S, LlamaFileType.MOSTLY_Q3_K_M),
    Q.Q4_K: (LlamaFileType.MOSTLY_Q4_K_S, LlamaFileType.MOSTLY_Q4_K_M),
    Q.Q5_K: (LlamaFileType.MOSTLY_Q5_K_S, LlamaFileType.MOSTLY_Q5_K_M),
}


def file_type(expert_type: Q, down_type: Q) -> LlamaFileType:
    """`general.file_type` after llama.cpp's names: Q4_K gate/up with Q6_K down is Q4_K_M, all Q4_K
    is Q4_K_S, Q8_0 experts are MOSTLY_Q8_0."""
    if expert_type in _K_SIZES:
        alike, larger = _K_SIZES[expert_type]
        bits = block_format(down_type).bits_per_weight
        return larger if bits > block_format(expert_type).bits_per_weight else alike
    return _FILE_TYPES[expert_type]


def write_model(path: str | Path, preset_name: str, *, expert_type: Q | None = None, down_type: Q | None = None,
                dense_type: Q = Q.Q8_0, seed: int = 0, split_max_bytes: int = 0,
                on_tensor: Callable[[str, int], None] | None = None, workers: int | None = None,
                layers: int | None = None, rope: RopeScaling = NO_ROPE_SCALING,
                mix: dict[int, tuple[Q, Q]] | None = None, chat_template: str | None = None,
                vocab_family: str | None = None) -> ModelSpec:
    """Write a synthetic GGUF of the preset's arch; `on_tensor(name, nbytes)` is called after each tensor.
    `expert_type`: None: the preset's (Q4_K; gpt-oss MXFP4). `workers`: None: up to 8, one a core.
    `chat_template`: written as `tokenizer.chat_template` (None: the preset's, `preset_template`);
    `vocab_family`: the added tokens (`vocab.FAMILIES`; None: the family the template writes, else qwen's)."""
    expert_type = PRESETS[preset_name].expert_type if expert_type is None else expert_type
    chat_template = preset_template(preset_name) if chat_template is None else chat_template
    vocab_family = vocab_family or family_of_template(chat_template) or DEFAULT_FAMILY
    down_type = DEFAULT_DOWN.get(expert_type, expert_type) if down_type is None else down_type  # F32 is 0
    spec = preset_spec(preset_name, layers, rope)
    plans = plan_tensors(spec, expert_type, down_type, dense_type, mix)
    vocab = build_vocab(spec.vocab_size, vocab_family)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    w = GGUFWriter(path, spec.arch, split_max_size=split_max_bytes)
    w.add_name(spec.name)
    w.add_block_count(spec.n_layers + spec.mtp_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.dense_ffn or spec.expert_ffn * spec.n_experts_used)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_base)
    if spec.rope_scaling.kind != RopeScalingType.NONE:
        w.add_rope_scaling_type(spec.rope_scaling.kind)
        w.add_rope_scaling_factor(spec.rope_scaling.factor)
        w.add_rope_scaling_orig_ctx_len(spec.rope_scaling.original_context)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_experts)
    w.add_expert_used_count(spec.n_experts_used)
    w.add_expert_feed_forward_length(spec.expert_ffn)
    if spec.delta is not None:  # as llama.cpp's converter writes Qwen3.5-MoE
        d = spec.delta
        w.add_expert_shared_feed_forward_length(spec.shared_expert_ffn)
        w.add_ssm_conv_kernel(d.conv_kernel)
        w.add_ssm_state_size(d.k_head_dim)
        w.add_ssm_group_count(d.n_k_heads)
        w.add_ssm_time_step_rank(d.n_v_heads)
        w.add_ssm_inner_size(d.value_dim)
        w.add_full_attention_interval(spec.full_attention_interval)
        if spec.mtp_layers:
            w.add_nextn_predict_layers(spec.mtp_layers)
        w.add_rope_dimension_count(spec.rotary_dim)
        if spec.arch == QWEN35MOE:  # its loader requires them (text positions: any sections read alike)
            w.add_rope_dimension_sections([11, 11, 10, 0])
    if spec.gpt_oss is not None:  # as llama.cpp's converter writes gpt-oss (the period: llama.cpp's default 2)
        assert spec.gpt_oss.swa_period == 2, "the writer writes no sliding_window_pattern"
        w.add_sliding_window(spec.gpt_oss.sliding_window)
    if spec.sigmoid_routing is not None:  # as llama.cpp's converter writes GLM-4.5
        r = spec.sigmoid_routing
        w.add_expert_shared_count(spec.shared_expert_ffn // spec.expert_ffn)
        w.add_leading_dense_block_count(spec.leading_dense)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(r.scale)
        w.add_expert_weights_norm(r.normalize)
        if r.n_groups > 1:
            w.add_expert_group_count(r.n_groups)
            w.add_expert_group_used_count(r.groups_used)
        w.add_nextn_predict_layers(spec.mtp_layers)
        w.add_rope_dimension_count(spec.rotary_dim)
    w.add_file_type(file_type(expert_type, down_type))
    w.add_quantization_version(2)
    w.add_string("strata.synthetic.seed", str(seed))
    write_vocab(w, vocab)
    w.add_chat_template(chat_template)

    for p in plans:
        fmt = block_format(p.ggml_type)
        if fmt.is_float and p.ggml_type != Q.BF16:
            dtype = np.float32 if p.ggml_type == Q.F32 else np.float16
            w.add_tensor_info(p.name, p.shape, np.dtype(dtype), p.nbytes)
        else:
            byte_shape = (*p.shape[:-1], fmt.row_bytes(p.shape[-1]))
            w.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), p.nbytes, raw_dtype=p.ggml_type)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if workers is None:
            workers = min(8, os.cpu_count() or 1)
        for p, data in zip(plans, tensors_in_order(plans, seed, workers), strict=True):
            w.write_tensor_data(data)
            if on_tensor:
                on_tensor(p.name, p.nbytes)
    finally:
        w.close()
    return spec
