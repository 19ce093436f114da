"""gpt-oss's own ops in plain torch, as transformers' `gpt_oss` and llama.cpp's `openai-moe` compute
them: attention whose softmax has one more logit a head (its learned sink, which takes a share of
the weight and no value), over a causal mask or a sliding window; the experts' SwiGLU with its
clamps and the +1 on up, each projection with its bias; the router's top-k of the biased logits,
softmaxed over those k alone.

Shape legend: T = query rows, S = key positions, H = query heads, Hkv = KV heads, G = H / Hkv,
Dh = head dim, D = hidden, E = experts, F = an expert's width, A = experts used per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Scores one slice of sink_attention holds at most ([Hkv, G, t, s] fp32: 256 MiB): a long prompt's
# rows are attended in slices of that many
SCORE_ELEMENTS = 1 << 26


@dataclass
class GptOssLayerWeights:
    """A gpt-oss layer's tensors beyond qwen3moe's (its q/k norms it has not), and its window."""

    window: int  # its sliding window (ModelSpec.window of its layer in the whole model); 0: full attention
    sinks: torch.Tensor  # [H] fp32: each head's sink logit
    bq: torch.Tensor  # [H*Dh]
    bk: torch.Tensor  # [Hkv*Dh]
    bv: torch.Tensor  # [Hkv*Dh]
    bo: torch.Tensor  # [D]
    router_bias: torch.Tensor  # [E] fp32
    gate_bias: torch.Tensor | None = None  # [E, F]; None where the experts were not loaded
    up_bias: torch.Tensor | None = None  # [E, F]
    down_bias: torch.Tensor | None = None  # [E, D]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   window: int = 0) -> torch.Tensor:
    """q [T, H, Dh], the last T positions of k, v [S, Hkv, Dh]; each query head j reads KV head j // G
    and sees the positions up to its own, only the last `window` of them (itself included) where
    window > 0. softmax over [scores, sinks[j]] with the sink's share dropped: -> [T, H, Dh] in
    q's dtype, computed in fp32."""
    t, h, dh = q.shape
    s, hkv = k.shape[0], k.shape[1]
    first = s - t  # q row 0's position
    rows = max(1, SCORE_ELEMENTS // (h * s))
    out = torch.empty(t, h, dh, device=q.device, dtype=torch.float32)
    sink = sinks.float().view(hkv, h // hkv, 1, 1)
    for a in range(0, t, rows):
        b = min(t, a + rows)
        lo = max(0, first + a - window + 1) if window else 0  # the slice's earliest visible key
        hi = first + b  # keys [lo, hi)
        pos_q = torch.arange(first + a, hi, device=q.device)[:, None]  # [t, 1]
        pos_k = torch.arange(lo, hi, device=q.device)[None, :]  # [1, s]
        visible = pos_k <= pos_q
        if window:
            visible &= pos_q - pos_k < window
        qg = q[a:b].float().view(b - a, hkv, h // hkv, dh).permute(1, 2, 0, 3)  # [Hkv, G, t, Dh]
        kg = k[lo:hi].float().permute(1, 2, 0)[:, None]  # [Hkv, 1, Dh, s]
        scores = (qg @ kg) * dh ** -0.5  # [Hkv, G, t, s]
        scores = scores.masked_fill(~visible, float("-inf"))
        logits = torch.cat([scores, sink.expand(-1, -1, b - a, 1)], dim=-1)  # [Hkv, G, t, s + 1]
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        vg = v[lo:hi].float().permute(1, 0, 2)[:, None]  # [Hkv, 1, s, Dh]
        out[a:b] = (probs @ vg).permute(2, 0, 1, 3).reshape(b - a, h, dh)
    return out.to(q.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gate, up [.., F] -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
    g = gate.clamp(max=limit)
    glu = g * torch.sigmoid(g * alpha)
    return (up.clamp(-limit, limit) + 1) * glu


def gpt_oss_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   gate_bias: torch.Tensor, up_bias: torch.Tensor, down_bias: torch.Tensor,
                   limit: float, alpha: float) -> torch.Tensor:
    """One expert over its rows x [n, D]: gate, up [F, D], down [D, F], their biases [F], [F], [D] -> [n, D]."""
    act = clamped_swiglu(x @ gate.T + gate_bias, x @ up.T + up_bias, limit, alpha)  # [n, F]
    return act @ down.T + down_bias


def route_topk_softmax(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, n_used: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D] -> (weights [T, A] fp32, experts [T, A]): the A largest of h router^T + bias, their
    softmax (llama.cpp's SOFTMAX_WEIGHT gating)."""
    logits = h.float() @ router.float().T + bias.float()  # [T, E]
    top, experts = torch.topk(logits, n_used, dim=-1)
    return torch.softmax(top, dim=-1), experts
