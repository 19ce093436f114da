"""A test-only twin of ggml's CPU expert matmuls that rounds as ggml does: each matmul's input
quantized to the weight type's vec_dot type (ggml-cpu's `type_traits_cpu[type].vec_dot_type`)
and dequantized back, then multiplied in float64 against the weights dequantized by the torch
twins. What is left between it and ggml is the order of fp32 sums, and the rounding ggml does
that this does not model (stated where tests/test_cpu_experts.py bounds it: Q8_1's block sums
kept in fp16, the fp16 products of F16 rows on CPUs with AVX512-FP16).

Shape legend: T = rows, D = hidden, F = expert width, A = picks a row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.kernels.cpu_experts import DEQUANT_MAX_VALUES, DEQUANT_ROWS, RateCounter, combine_picks
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.quant.dequant import dequantize_rows

# ggml-cpu's vec_dot_type of each served type (checked against ggml's own table by the tests)
VEC_DOT = {Q.F32: Q.F32, Q.F16: Q.F16, Q.BF16: Q.BF16, Q.Q4_0: Q.Q8_0, Q.Q4_1: Q.Q8_1, Q.Q5_0: Q.Q8_0,
           Q.Q5_1: Q.Q8_1, Q.Q8_0: Q.Q8_0, Q.IQ4_NL: Q.Q8_0, Q.MXFP4: Q.Q8_0}
VEC_DOT.update({t: Q.Q8_K for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S,
                                    Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.TQ1_0, Q.TQ2_0)})


def vec_dot_values(x: torch.Tensor, vec_type: Q) -> torch.Tensor:
    """x [R, n] fp32 as ggml hands it to a vec_dot of `vec_type`: rounded to fp16 or bf16; Q8_0
    and Q8_1 (runs of 32): q = round(x * 127 / amax), times amax / 127 kept in fp16; Q8_K (runs of
    256): q = round(x * -127 / m), m the run's value of largest magnitude, q at most 127, times
    the fp32 m / -127. Returned as fp32 values."""
    if vec_type == Q.F32:
        return x
    if vec_type == Q.F16:
        return x.half().float()
    if vec_type == Q.BF16:
        return x.bfloat16().float()
    if vec_type in (Q.Q8_0, Q.Q8_1):
        runs = x.reshape(-1, 32)
        amax = runs.abs().amax(1, keepdim=True)
        q = torch.round(runs * torch.where(amax > 0, 127 / amax, 0.0))
        return (q * (amax / 127).half().float()).reshape(x.shape)
    if vec_type == Q.Q8_K:
        runs = x.reshape(-1, 256)
        m = runs.gather(1, runs.abs().argmax(1, keepdim=True))
        iscale = torch.where(m != 0, -127 / m, 0.0)
        q = torch.round(runs * iscale).clamp(max=127)
        return (q * torch.where(iscale != 0, 1 / iscale, 0.0)).reshape(x.shape)
    raise ValueError(f"no rounding model for {vec_type.name}")


class RoundingTwin(RateCounter):
    """An executor (`kernels.cpu_experts`' contract) computing each pick as ggml rounds it."""

    name = "rounding-twin"
    threads = 0

    def describe(self) -> str:
        return "the torch twin rounding as ggml"

    def moe(self, layer: torch.Tensor, lay: ExpertLayout, h: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor) -> torch.Tensor:
        t, a = experts.shape
        d = h.shape[1]
        f = lay.gate_weights // d
        by_expert = layer.view(-1, lay.expert_bytes)
        xq = vec_dot_values(h.float(), VEC_DOT[lay.gate_type]).double()  # [T, D]
        y = torch.empty(t, a, d, dtype=torch.float32)
        for e in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == e)
            src = by_expert[e]
            gu = dequantize_rows(src[:2 * lay.gate_bytes].reshape(2 * f, -1), lay.gate_type, d).double()  # [2F, D]
            wd = dequantize_rows(src[lay.down_offset:lay.down_offset + lay.down_bytes].reshape(d, -1),
                                 lay.down_type, f).double()  # [D, F]
            g = (xq[rows] @ gu.T).float()  # [n, 2F]
            act = F.silu(g[:, :f]) * g[:, f:]  # [n, F]
            y[rows, slot] = (vec_dot_values(act, VEC_DOT[lay.down_type]).double() @ wd.T).float()
        self.count(t, 0, 0.0)
        return combine_picks(y, weights)

    def matmul(self, x: torch.Tensor, raw: torch.Tensor, ggml_type: Q, k: int) -> torch.Tensor:
        """x [T, K] times W.T as `GgmlExperts.matmul` rounds it: x as W's vec_dot type takes it
        below DEQUANT_ROWS rows (and for a W of more than DEQUANT_MAX_VALUES); else W dequantized
        and x as it is."""
        w = dequantize_rows(raw, ggml_type, k).double()  # [N, K]
        dequantizes = x.shape[0] >= DEQUANT_ROWS and raw.shape[0] * k <= DEQUANT_MAX_VALUES
        xq = x.float() if dequantizes else vec_dot_values(x.float(), VEC_DOT[ggml_type])
        return (xq.double() @ w.T).float()
