"""Dense float weights of a model (or a layer range of it), dequantized from GGUF."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import ModelSpec, T, tname
from strata_mgpu.quant.dequant import dequantize


@dataclass
class LayerWeights:
    """One decoder layer. Shapes: D hidden, E experts, F expert width, Hkv*Dh = KV width."""

    attn_norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [H*Dh, D]
    wk: torch.Tensor  # [Hkv*Dh, D]
    wv: torch.Tensor  # [Hkv*Dh, D]
    wo: torch.Tensor  # [D, H*Dh]
    q_norm: torch.Tensor  # [Dh]
    k_norm: torch.Tensor  # [Dh]
    ffn_norm: torch.Tensor  # [D]
    router: torch.Tensor  # [E, D], fp32
    gate: torch.Tensor | None = None  # [E, F, D]; None where the experts are streamed
    up: torch.Tensor | None = None  # [E, F, D]
    down: torch.Tensor | None = None  # [E, D, F]
    # [(H + 2 Hkv) * Dh, D]: the three projections in one matrix (wq, wk, wv are its row blocks),
    # so that a decode step reads them in one GEMM; None where they were made apart
    wqkv: torch.Tensor | None = None


@dataclass
class ModelWeights:
    """The dense weights of a layer range; the embedding where it is the first stage, the final
    norm and head where it is the last (None elsewhere)."""

    embed: torch.Tensor | None  # [V, D]
    layers: list[LayerWeights]
    out_norm: torch.Tensor | None  # [D]
    output: torch.Tensor | None  # [V, D]; the embedding itself when tied

    @property
    def device(self) -> torch.device:
        return self.layers[0].wq.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].wq.dtype


def load_weights(f: GGUFFile, spec: ModelSpec, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", with_experts: bool = True, layers: range | None = None,
                 embed: bool = True, head: bool = True,
                 on_layer: Callable[[int], None] | None = None) -> ModelWeights:
    """Dequantize the tensors of `layers` (default: all) to `dtype` on `device` (the router stays
    fp32); without experts when they are streamed; the embedding and the head only if asked.
    `on_layer(i)` reports progress."""

    def get(kind: T, layer: int | None = None, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        name = tname(kind, layer)
        info = f.tensor(name)
        return dequantize(f.tensor_data(name), info.ggml_type, info.shape, device).to(as_dtype)

    out_layers = []
    for i in layers if layers is not None else range(spec.n_layers):
        wqkv = torch.cat([get(T.ATTN_Q, i), get(T.ATTN_K, i), get(T.ATTN_V, i)])
        wq, wk, wv = wqkv.split([spec.q_dim, spec.kv_dim, spec.kv_dim])
        lw = LayerWeights(
            attn_norm=get(T.ATTN_NORM, i), wq=wq, wk=wk, wv=wv, wqkv=wqkv,
            wo=get(T.ATTN_OUT, i), q_norm=get(T.ATTN_Q_NORM, i), k_norm=get(T.ATTN_K_NORM, i),
            ffn_norm=get(T.FFN_NORM, i), router=get(T.FFN_GATE_INP, i, torch.float32))
        if with_experts:
            lw.gate, lw.up, lw.down = get(T.FFN_GATE_EXP, i), get(T.FFN_UP_EXP, i), get(T.FFN_DOWN_EXP, i)
        out_layers.append(lw)
        if on_layer:
            on_layer(i)
    embedding = get(T.TOKEN_EMBD) if embed or (head and spec.tied_output) else None
    output = (embedding if spec.tied_output else get(T.OUTPUT)) if head else None
    return ModelWeights(embed=embedding if embed else None, layers=out_layers,
                        out_norm=get(T.OUTPUT_NORM) if head else None, output=output)
