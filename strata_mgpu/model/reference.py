"""The oracle: the decoder forward over dense dequantized weights (fp32 by default), the routed
experts computed one at a time. Every fast path is checked against it, and it against Hugging Face
transformers' Qwen3-MoE (tests/test_reference_oracle.py; the other archs' in tests/test_hybrid.py and
tests/test_gpt_oss.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.decoder import Decoder
from strata_mgpu.model.gpt_oss import gpt_oss_expert
from strata_mgpu.model.kv_cache import PLAIN_KV
from strata_mgpu.model.spec import GptOssShape, ModelSpec
from strata_mgpu.model.weights import LayerWeights, ModelWeights


def moe_reference(h: torch.Tensor, w: LayerWeights, weights: torch.Tensor, experts: torch.Tensor,
                  oss: GptOssShape | None = None) -> torch.Tensor:
    """SiLU-gated experts (gpt-oss's: `oss`, clamped SwiGLU and biases), one expert at a time. h [T, D] -> [T, D]."""
    assert w.gate is not None and w.up is not None and w.down is not None, "the layer's experts were loaded"
    out = torch.zeros_like(h)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)  # token rows routed to e, and which of their A picks it is
        x = h[rows]  # [n, D]
        if oss is None:
            y = (F.silu(x @ w.gate[e].T) * (x @ w.up[e].T)) @ w.down[e].T  # [n, D]
        else:
            b = w.oss
            assert b is not None and b.gate_bias is not None and b.up_bias is not None and b.down_bias is not None
            y = gpt_oss_expert(x, w.gate[e], w.up[e], w.down[e], b.gate_bias[e], b.up_bias[e], b.down_bias[e],
                               oss.swiglu_limit, oss.swiglu_alpha)
        out.index_add_(0, rows, y * weights[rows, slot, None].to(h.dtype))
    return out


class DenseExperts:
    """The oracle's `ExpertBackend`: experts from dequantized tensors in memory, one at a time."""

    def __init__(self, layers: Sequence[LayerWeights], oss: GptOssShape | None = None):
        self.layers, self.oss = layers, oss

    def should_stream(self, n_rows: int) -> bool:
        return False

    def in_halves(self, n_rows: int) -> bool:
        return False

    def begin(self, n_rows: int, stream: bool) -> None:
        pass

    def start(self, layer: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              hq: torch.Tensor | None = None, first: bool = True) -> torch.Tensor:
        return moe_reference(h, self.layers[layer], weights, experts, self.oss)  # in h's own precision: hq unused

    def finish(self, started: torch.Tensor) -> torch.Tensor:
        return started

    def abort(self) -> None:
        pass


class ReferenceModel(Decoder):
    """The oracle: dense dequantized weights, experts one at a time."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights,
                 kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV):
        super().__init__(spec, weights, DenseExperts(weights.layers, spec.gpt_oss), kv_types=kv_types)
