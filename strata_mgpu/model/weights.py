"""Dense weights of a model (or a layer range of it) from GGUF: dequantized to a float dtype, or,
for the projections of a stage that multiplies blocks in place, kept as their GGUF blocks
(`BlockMatrix`), where decode reads each projection once a step and the blocks are fewer bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.gpt_oss import GptOssLayerWeights
from strata_mgpu.model.spec import QWEN3NEXT, ModelSpec, T, tname
from strata_mgpu.quant.dequant import dequantize


@dataclass(frozen=True)
class BlockMatrix:
    """A projection W [N, K] kept as the file stores it: raw [N, row_bytes] uint8, each row K values in
    blocks of `ggml_type`."""

    raw: torch.Tensor  # [N, row_bytes] uint8
    ggml_type: GGMLQuantizationType
    k: int  # values a row

    @property
    def n(self) -> int:
        return self.raw.shape[0]

    def row_block(self, start: int, stop: int) -> BlockMatrix:
        """Rows [start, stop) of W: a view of the same bytes."""
        return BlockMatrix(self.raw[start:stop], self.ggml_type, self.k)


# A projection as the decoder multiplies it: a float tensor [N, K], or its blocks
Matrix = torch.Tensor | BlockMatrix
# (a projection's type, K) -> whether the stage keeps it as blocks (what its DenseMatmul multiplies)
KeepBlocks = Callable[[GGMLQuantizationType, int], bool]


def every_type(ggml_type: GGMLQuantizationType, k: int) -> bool:
    return True


@dataclass
class DeltaNetWeights:
    """A gated DeltaNet layer's token mixer (`model.delta_net`). C = 2 Hk Dk + Hv Dv conv channels."""

    wqkv: Matrix  # [C, D]: q, k and v before the conv
    wz: Matrix  # [Hv*Dv, D]: the output norm's gate
    w_beta: torch.Tensor  # [Hv, D]
    w_alpha: torch.Tensor  # [Hv, D]
    conv: torch.Tensor  # [C, K]
    dt_bias: torch.Tensor  # [Hv]
    decay_rate: torch.Tensor  # [Hv]: -exp(A_log), the file's ssm_a
    norm: torch.Tensor  # [Dv]
    wout: Matrix  # [D, Hv*Dv]
    key_heads: torch.Tensor  # [Hv] int64: the key head each value head reads


@dataclass
class SharedExpertWeights:
    """The shared expert: a dense SiLU-gated MLP every token takes, scaled by sigmoid(h . gate_inp) where
    it has that gate (qwen35moe's; glm4moe's has none). A dense layer's FFN is the same MLP, ungated."""

    gate: Matrix  # [Fs, D]
    up: Matrix  # [Fs, D]
    down: Matrix  # [D, Fs]
    gate_inp: torch.Tensor | None = None  # [D]


@dataclass
class LayerWeights:
    """One decoder layer. Shapes: D hidden, E experts, F expert width, Hkv*Dh = KV width. Its token
    mixer is full attention (wq ... k_norm) or, where `delta` is set, gated DeltaNet (the attention
    fields None). A dense layer (`ModelSpec.is_dense`) has `mlp` and no router or experts."""

    attn_norm: torch.Tensor  # [D]
    wq: Matrix | None  # [H*Dh, D] ([2*H*Dh, D] with an output gate: each head's query, then its gate)
    wk: Matrix | None  # [Hkv*Dh, D]
    wv: Matrix | None  # [Hkv*Dh, D]
    wo: Matrix | None  # [D, H*Dh]
    q_norm: torch.Tensor | None  # [Dh]
    k_norm: torch.Tensor | None  # [Dh]
    ffn_norm: torch.Tensor  # [D]
    router: torch.Tensor | None  # [E, D], fp32; None in a dense layer
    gate: torch.Tensor | None = None  # [E, F, D]; None where the experts are streamed
    up: torch.Tensor | None = None  # [E, F, D]
    down: torch.Tensor | None = None  # [E, D, F]
    # [(H + 2 Hkv) * Dh, D]: the three projections in one matrix (wq, wk, wv are its row blocks),
    # so that a decode step reads them in one GEMM; None where they were made apart
    wqkv: Matrix | None = None
    delta: DeltaNetWeights | None = None
    shared: SharedExpertWeights | None = None
    mlp: SharedExpertWeights | None = None  # a dense layer's FFN (ungated), in place of the MoE block
    # glm4moe's: the projections' biases [H*Dh], [Hkv*Dh], [Hkv*Dh], and the router's choice bias [E] fp32
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    expert_bias: torch.Tensor | None = None
    oss: GptOssLayerWeights | None = None


@dataclass
class ModelWeights:
    """The dense weights of a layer range; the embedding on the first stage, the final norm and head on
    the last (None elsewhere)."""

    embed: Matrix | None  # [V, D]: rows looked up by token
    layers: list[LayerWeights]
    out_norm: torch.Tensor | None  # [D]
    output: Matrix | None  # [V, D]; the embedding itself when tied

    @property
    def device(self) -> torch.device:
        return self.layers[0].attn_norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].attn_norm.dtype


def load_weights(f: GGUFFile, spec: ModelSpec, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", with_experts: bool = True, layers: range | None = None,
                 embed: bool = True, head: bool = True, blocks: KeepBlocks | None = None,
                 embed_blocks: bool = False, on_layer: Callable[[int], None] | None = None) -> ModelWeights:
    """Dequantize `layers` (default: all) to `dtype` on `device` (the router stays fp32), without
    experts when they are streamed. `blocks`: projections kept as blocks (q, k, v one matrix where
    their types agree); `embed_blocks`: the embedding too. `on_layer(i)` reports progress."""

    def get(kind: T, layer: int | None = None, as_dtype: torch.dtype = dtype, suffix: str = ".weight") -> torch.Tensor:
        name = tname(kind, layer, suffix)
        info = f.tensor(name)
        return dequantize(f.tensor_data(name), info.ggml_type, info.shape, device).to(as_dtype)

    def raw(*kinds_layer: tuple[T, int | None]) -> BlockMatrix:
        infos = [f.tensor(tname(kind, layer)) for kind, layer in kinds_layer]
        data = np.concatenate([f.tensor_data(tname(kind, layer)) for kind, layer in kinds_layer])
        return BlockMatrix(torch.from_numpy(data).to(device), infos[0].ggml_type, infos[0].shape[-1])

    def kept(kind: T, layer: int | None = None) -> bool:
        info = f.tensor(tname(kind, layer))
        return blocks is not None and blocks(info.ggml_type, info.shape[-1])

    def matrix(kind: T, layer: int | None = None) -> Matrix:
        return raw((kind, layer)) if kept(kind, layer) else get(kind, layer)

    def _experts(lw: LayerWeights, i: int) -> None:
        if with_experts:
            lw.gate, lw.up, lw.down = get(T.FFN_GATE_EXP, i), get(T.FFN_UP_EXP, i), get(T.FFN_DOWN_EXP, i)
            if lw.oss is not None:
                lw.oss.gate_bias, lw.oss.up_bias, lw.oss.down_bias = (
                    get(kind, i, suffix=".bias") for kind in (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP))

    def oss(i: int) -> GptOssLayerWeights:
        def bias(kind: T) -> torch.Tensor:
            return get(kind, i, suffix=".bias")
        return GptOssLayerWeights(window=spec.window(i), sinks=get(T.ATTN_SINKS, i, torch.float32),
                                  bq=bias(T.ATTN_Q), bk=bias(T.ATTN_K), bv=bias(T.ATTN_V), bo=bias(T.ATTN_OUT),
                                  router_bias=get(T.FFN_GATE_INP, i, torch.float32, ".bias"))

    def same_blocks(*kinds_layer: tuple[T, int | None]) -> bool:
        infos = [f.tensor(tname(kind, layer)) for kind, layer in kinds_layer]
        return len({(info.ggml_type, info.shape[-1]) for info in infos}) == 1

    def delta(i: int) -> DeltaNetWeights:
        d = spec.delta
        assert d is not None
        if spec.arch == QWEN3NEXT:  # ssm_ba [Hk, (beta r, alpha r), D], r = Hv / Hk: each key head's value heads
            ba = get(T.SSM_BETA_ALPHA, i).view(d.n_k_heads, 2, d.n_v_heads // d.n_k_heads, spec.hidden)
            w_beta, w_alpha = (ba[:, j].reshape(d.n_v_heads, spec.hidden) for j in range(2))
        else:
            w_beta, w_alpha = get(T.SSM_BETA, i), get(T.SSM_ALPHA, i)
        return DeltaNetWeights(
            wqkv=matrix(T.ATTN_QKV, i), wz=matrix(T.ATTN_GATE, i), w_beta=w_beta,
            w_alpha=w_alpha, conv=get(T.SSM_CONV1D, i), dt_bias=get(T.SSM_DT, i, suffix=".bias"),
            decay_rate=get(T.SSM_A, i, suffix=""), norm=get(T.SSM_NORM, i), wout=matrix(T.SSM_OUT, i),
            key_heads=torch.tensor(d.key_head_of(), device=device))

    def shared(i: int) -> SharedExpertWeights:
        gated = tname(T.FFN_GATE_INP_SHEXP, i) in f.tensors
        return SharedExpertWeights(gate=matrix(T.FFN_GATE_SHEXP, i), up=matrix(T.FFN_UP_SHEXP, i),
                                   down=matrix(T.FFN_DOWN_SHEXP, i),
                                   gate_inp=get(T.FFN_GATE_INP_SHEXP, i).reshape(spec.hidden) if gated else None)

    out_layers = []
    for i in layers if layers is not None else range(spec.n_layers):
        dense_layer = spec.is_dense(i)
        ffn_norm = get(spec.ffn_norm_kind, i)
        router = None if dense_layer else get(T.FFN_GATE_INP, i, torch.float32)
        shared_expert = shared(i) if spec.shared_expert_ffn and not dense_layer else None
        if spec.is_linear(i):
            lw = LayerWeights(attn_norm=get(T.ATTN_NORM, i), wq=None, wk=None, wv=None, wo=None, q_norm=None,
                              k_norm=None, ffn_norm=ffn_norm, router=router, shared=shared_expert, delta=delta(i))
            _experts(lw, i)
            out_layers.append(lw)
            if on_layer:
                on_layer(i)
            continue
        qkv = ((T.ATTN_Q, i), (T.ATTN_K, i), (T.ATTN_V, i))
        wqkv: Matrix | None
        wq: Matrix
        wk: Matrix
        wv: Matrix
        wo: Matrix
        keep = [kept(*kl) for kl in qkv]
        if all(keep) and same_blocks(*qkv):
            wqkv = raw(*qkv)
            wq, wk, wv = (wqkv.row_block(a, b) for a, b in _row_ranges(spec.q_proj_dim, spec.kv_dim, spec.kv_dim))
        elif not any(keep):
            wqkv = torch.cat([get(T.ATTN_Q, i), get(T.ATTN_K, i), get(T.ATTN_V, i)])
            wq, wk, wv = wqkv.split([spec.q_proj_dim, spec.kv_dim, spec.kv_dim])
        else:
            wqkv, (wq, wk, wv) = None, (matrix(*kl) for kl in qkv)
        wo = matrix(T.ATTN_OUT, i)
        gpt_oss = spec.gpt_oss is not None  # biases and sinks, no q/k norms
        lw = LayerWeights(
            attn_norm=get(T.ATTN_NORM, i), wq=wq, wk=wk, wv=wv, wqkv=wqkv, wo=wo,
            q_norm=get(T.ATTN_Q_NORM, i) if spec.qk_norm and not gpt_oss else None,
            k_norm=get(T.ATTN_K_NORM, i) if spec.qk_norm and not gpt_oss else None,
            ffn_norm=ffn_norm, router=router, shared=shared_expert, oss=oss(i) if gpt_oss else None)
        if spec.attn_bias:  # glm4moe's q/k/v biases (gpt-oss's are its `oss`)
            lw.bq, lw.bk, lw.bv = (get(kind, i, suffix=".bias") for kind in (T.ATTN_Q, T.ATTN_K, T.ATTN_V))
        if dense_layer:
            lw.mlp = SharedExpertWeights(gate=matrix(T.FFN_GATE, i), up=matrix(T.FFN_UP, i), down=matrix(T.FFN_DOWN, i))
        else:
            if spec.sigmoid_routing is not None:  # glm4moe's router's choice bias
                lw.expert_bias = get(T.FFN_EXP_PROBS_B, i, torch.float32, ".bias")
            _experts(lw, i)
        out_layers.append(lw)
        if on_layer:
            on_layer(i)
    embedding: Matrix | None = None
    if embed or (head and spec.tied_output):
        embedding = raw((T.TOKEN_EMBD, None)) if embed_blocks else get(T.TOKEN_EMBD)
    output: Matrix | None = None
    if head:
        output = embedding if spec.tied_output else matrix(T.OUTPUT)
    return ModelWeights(embed=embedding if embed else None, layers=out_layers,
                        out_norm=get(T.OUTPUT_NORM) if head else None, output=output)


def _row_ranges(*sizes: int) -> list[tuple[int, int]]:
    ends = np.cumsum(sizes).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))
