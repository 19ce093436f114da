"""The gated DeltaNet layer (Qwen3.5/3.6-MoE's linear attention) in plain torch: a causal conv1d
over the projected q, k and v, then the gated delta rule per value head, a gated RMSNorm and the
output projection.

Shape legend: T = token rows of one sequence, D = hidden, C = conv channels (2 Hk Dk + Hv Dv),
K = conv width, Hk / Hv = key / value heads, Dk / Dv = their head dims.

The delta rule, per value head with state S [Dk, Dv] and each token's decay g (log space, <= 0)
and rate beta: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; out = S^T q. A prompt runs it as a
chunked scan (`delta_rule_chunked`: a chunk's updates solved as one triangular system), a decode
step as the one-step recurrence (`delta_rule_steps`, also the chunked scan's plain twin). A decode
step of B sequences at once (their states gathered from a `StatePool` by slot) runs `conv_step` and
`delta_step` over all B rows: B = rows of such a step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from strata_mgpu.model.ops import rms_norm
from strata_mgpu.model.spec import DeltaNetShape

CHUNK = 64  # tokens a chunk of the scan solves at once


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv then SiLU. x [T, C] new inputs, state [C, K - 1] the inputs before them
    (zeros at a sequence's start), weight [C, K] -> (out [T, C], the new state [C, K - 1])."""
    k = weight.shape[1]
    xs = torch.cat([state.to(x.dtype), x.T], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(xs[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).T, xs[:, xs.shape[1] - (k - 1):].clone()


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` of one token for each of B sequences: x [B, C], state [B, C, K - 1], weight [C, K]
    -> (out [B, C], the new states [B, C, K - 1]). Summed in fp32, as the conv kernels accumulate."""
    xs = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = (xs.float() * weight.float()[None]).sum(-1).to(x.dtype)  # [B, C]
    return F.silu(out), xs[:, :, 1:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x|| over the last dim, as transformers' (and fla's) x * rsqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence a token at a time. q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state
    [H, Dk, Dv], all fp32 -> (out [T, H, Dv], the new state)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        out[t], state = delta_step(q[t], k[t], v[t], g[t], beta[t], state)
    return out, state


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence, over any leading dims (none, or B sequences'): q, k [..., H, Dk],
    v [..., H, Dv], g, beta [..., H], state [..., H, Dk, Dv], fp32 -> (out [..., H, Dv], the new state)."""
    state = state * g.exp()[..., None, None]
    delta = (v - torch.einsum("...kv,...k->...v", state, k)) * beta[..., None]  # [..., H, Dv]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("...kv,...k->...v", state, q), state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `delta_rule_steps`, a chunk of tokens at a time. Within a chunk, with G_t the decay
    summed from the chunk's start and S0 the state before it, token t's update u_t (the delta) solves
    u_t + beta_t sum_{s<t} e^(G_t - G_s) (k_t . k_s) u_s = beta_t (v_t - e^(G_t) S0^T k_t), a unit
    lower-triangular system; then out_t = e^(G_t) S0^T q_t + sum_{s<=t} e^(G_t - G_s) (q_t . k_s) u_s
    and the state after the chunk is e^(G_n) S0 + sum_s e^(G_n - G_s) k_s u_s^T."""
    out = torch.empty_like(v)
    for c0 in range(0, q.shape[0], chunk):
        c = slice(c0, min(c0 + chunk, q.shape[0]))
        qc, kc, vc = q[c].transpose(0, 1), k[c].transpose(0, 1), v[c].transpose(0, 1)  # [H, n, D]
        bc = beta[c].T[:, :, None]  # [H, n, 1]
        cum = g[c].T.cumsum(-1)  # [H, n]
        n = cum.shape[1]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, n, n], e^(G_t - G_s)
        a = (bc * (kc @ kc.transpose(1, 2)) * decay).tril(-1)  # strictly lower
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        grow = cum.exp()[:, :, None]  # [H, n, 1], e^(G_t)
        rhs = bc * (vc - (grow * kc) @ state)  # [H, n, Dv]
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        out[c] = ((grow * qc) @ state + ((qc @ kc.transpose(1, 2)) * decay) @ u).transpose(0, 1)
        last = cum[:, -1:]  # [H, 1]
        state = state * last.exp()[:, :, None] + (kc * (last - cum).exp()[:, :, None]).transpose(1, 2) @ u
    return out, state


# what computes a prompt's rows: `delta_rule_chunked`, or a kernel of its contract (kernels/delta_rule.py)
DeltaScan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]]


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, scan: DeltaScan = delta_rule_chunked) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's one token by the recurrence, more by the chunked scan (`scan`)."""
    if q.shape[0] == 1:
        return delta_rule_steps(q, k, v, g, beta, state)
    return scan(q, k, v, g, beta, state)


def delta_heads(shape: DeltaNetShape, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                decay_rate: torch.Tensor, key_heads: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output qkv [T, C] and the raw rates a, b [T, Hv] -> the rule's inputs, fp32: q, k
    [T, Hv, Dk] (L2-normed, q scaled by Dk^-1/2, each value head's key head picked by `key_heads`
    [Hv]), v [T, Hv, Dv], g = decay_rate * softplus(a + dt_bias) and beta = sigmoid(b), [T, Hv] each
    (decay_rate = -exp(A_log): the file's ssm_a)."""
    s, t = shape, qkv.shape[0]
    q, k, v = qkv.float().split([s.key_dim, s.key_dim, s.value_dim], dim=1)
    q = l2norm(q.reshape(t, s.n_k_heads, s.k_head_dim)) * s.k_head_dim ** -0.5
    k = l2norm(k.reshape(t, s.n_k_heads, s.k_head_dim))
    g = decay_rate.float() * F.softplus(a.float() + dt_bias.float())
    return (q.index_select(1, key_heads), k.index_select(1, key_heads), v.reshape(t, s.n_v_heads, s.v_head_dim),
            g, torch.sigmoid(b.float()))


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output o [T, Hv, Dv] by weight [Dv], times SiLU of its gate z [T, Hv, Dv]."""
    return rms_norm(o, weight, eps) * F.silu(z.float()).to(o.dtype)
