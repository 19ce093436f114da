"""The decoder's small ops in plain torch, and `DecodeOps`, the twins of the fused CUDA versions a
GPU stage passes to its `Decoder` (`kernels.decode_ops`).

Shape legend: T = token rows, D = hidden, H = query heads, Hkv = KV heads, Dh = head dim,
E = experts, A = experts used per token, S = keys, B = rows of a decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from gguf.constants import RopeScalingType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from strata_mgpu.model.kv_cache import SequenceKV
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.weights import LayerWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in fp32, cast back, then scaled (as transformers does)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def rope_inv_freq(spec: ModelSpec, device: torch.device) -> torch.Tensor:
    """RoPE's frequencies [Dh/2] fp32 (radians a position), scaled as `spec.rope_scaling` says, in
    transformers' arithmetic (llama.cpp's `rope_yarn` is the same mix). Made on `device` with no
    host copy: a captured decode step computes its tables inside the graph."""
    dh, r = spec.rotary_dim, spec.rope_scaling
    pos_freqs = spec.rope_base ** (torch.arange(0, dh, 2, device=device, dtype=torch.float32) / dh)  # [Dh/2]
    kept = 1.0 / pos_freqs
    if r.kind == RopeScalingType.NONE:
        return kept
    divided = 1.0 / (r.factor * pos_freqs)
    if r.kind == RopeScalingType.LINEAR:
        return divided
    low, high = r.correction_range(dh, spec.rope_base)
    # 0 up to frequency `low` (the fast ones: kept), 1 from `high` on (the slow ones: divided)
    ramp = ((torch.arange(dh // 2, device=device, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return divided * ramp + kept * (1 - ramp)


def rope_cos_sin(positions: torch.Tensor, spec: ModelSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """NEOX-style rotary tables of positions [T]: cos and sin [T, R] each (R = the dims rotated, Dh
    unless the spec rotates a part of each head), times the scaling's mscale,
    computed in fp32 and then cast. The one place RoPE is computed: every path rotates by these."""
    freqs = positions.float()[:, None] * rope_inv_freq(spec, positions.device)[None, :]  # [T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, R]
    cos, sin = emb.cos(), emb.sin()
    mscale = spec.rope_scaling.mscale
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh]: rotate the two halves of each head's first R dims (cos, sin [T, R]; NEOX / HF
    rotate_half); the rest pass as they are."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qk_norm_rope(spec: ModelSpec, w: LayerWeights, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H*Dh], k [T, Hkv*Dh] -> q [T, H, Dh], k [T, Hkv, Dh], each head RMS-normed (where the layer
    has q/k norms: gpt-oss's has none, glm4moe's may not) and rotated."""
    t = q.shape[0]
    q, k = q.reshape(t, spec.n_heads, spec.head_dim), k.reshape(t, spec.n_kv_heads, spec.head_dim)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = rms_norm(q, w.q_norm, spec.rms_eps), rms_norm(k, w.k_norm, spec.rms_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


# cuDNN's attention builds a graph per new shape: host time on every call in decode, where the
# key count grows every step (docs/BENCHMARKS.md). Flash, memory-efficient or math kernels serve
# every shape here.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, Dh] are the last T positions of k, v [S, Hkv, Dh]; returns [T, H, Dh]."""
    with sdpa_kernel(SDPA_BACKENDS):
        return _sdpa(q, k, v)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t, s = q.shape[0], k.shape[0]
    if t == 1 and q.device.type == "cpu" and q.dtype == torch.float32 and s > 1:
        return one_query_attention(q, k, v)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if t == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    elif t == 1:  # one new token sees every key: no mask (a mask would send SDPA to a slower kernel)
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    else:  # a chunk after a prefix: query i sits at key s - t + i and sees keys 0..s-t+i.
        # A lower-right causal bias keeps the flash/efficient kernels (an explicit [T, S] mask sends
        # GQA to the math kernel, whose [H, T, S] scores outgrow VRAM for a long chunk after a long
        # prefix); they take no GQA flag, so the KV heads are repeated for this call.
        group = q.shape[1] // k.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, s))
    return out[0].transpose(0, 1)


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query row q [1, H, Dh] over every key of k, v [S, Hkv, Dh] -> [1, H, Dh]. A CPU decode
    step's attention: torch's CPU SDPA tiles for many queries and is slow for one; the same
    arithmetic in fp32, summed in another order."""
    h, dh, hkv = q.shape[1], q.shape[2], k.shape[1]
    scores = torch.bmm(q[0].reshape(hkv, h // hkv, dh), k.permute(1, 2, 0)) * dh ** -0.5  # [Hkv, G, S]
    return torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1)).view(1, h, dh)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [T, H, Dh] against all of k, v [S, Hkv, Dh] where visible [S] (bool) allows; -> [T, H, Dh]."""
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible[None, :], enable_gqa=True)
    return out[0].transpose(0, 1)


def block_table(kv: SequenceKV) -> tuple[torch.Tensor, int] | None:
    """A paged cache's (block table, block tokens B): position p sits in cell table[p // B] * B + p % B
    of `kv.k` / `kv.v` (the table int32 [max_blocks] on the cache's device, B a power of two); None
    where cell = position."""
    return None if kv.block_table is None else (kv.block_table, kv.block_tokens)


def kv_cells(kv: SequenceKV, positions: torch.Tensor) -> torch.Tensor:
    """The cells of kv.k / kv.v [L, cells, Hkv, row] holding `positions` [N] int64 -> [N] int64: the
    positions themselves in a contiguous cache, else through its block table."""
    paged = block_table(kv)
    if paged is None:
        return positions
    table, b = paged
    return table[positions // b].long() * b + positions % b


def sequence_cells(kv: SequenceKV, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s stored keys and values of positions 0..capacity-1, in position order
    ([capacity, Hkv, row] each): views of a contiguous cache, gathered from a paged one's blocks."""
    k, v = kv.k[layer], kv.v[layer]
    if block_table(kv) is None:
        return k, v
    cells = kv_cells(kv, torch.arange(kv.capacity, device=k.device))
    return k[cells], v[cells]


def route(h: torch.Tensor, router: torch.Tensor, n_used: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router softmax -> top-k -> renormalize. h [T, D] -> (weights [T, A] fp32, experts [T, A])."""
    probs = torch.softmax(h.float() @ router.float().T, dim=-1)  # [T, E], fp32 whatever h's dtype
    weights, experts = torch.topk(probs, n_used, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


class DecodeOps:
    """The small ops of the static decode step, as plain torch: the twins of `kernels.decode_ops`."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, rms_norm(x + y)): the residual stream and the next block's input. The fused version
        updates x in place."""
        x = x + y
        return x, rms_norm(x, weight, eps)

    def qk_norm_rope_kv(self, spec: ModelSpec, w: LayerWeights, layer: int, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        kvs: Sequence[SequenceKV], table: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H*Dh], k and v [B, Hkv*Dh], row b one token of sequence kvs[b]: q and k normed per head and
        rotated; row b's k and v written at positions[b] of layer `layer` of kvs[b]'s cache as its
        format stores them; returns q [B, H, Dh]."""
        qn, kn = qk_norm_rope(spec, w, q, k, cos, sin)
        for b, kv in enumerate(kvs):
            r, f = slice(b, b + 1), kv.format
            cells = kv_cells(kv, positions[r])
            kv.k[layer].index_copy_(0, cells, f.store(f.keys, kn[r]).to(kv.k.dtype))
            kv.v[layer].index_copy_(0, cells, f.store(f.values, v[r].view(1, spec.n_kv_heads,
                                                                          spec.head_dim)).to(kv.v.dtype))
        return qn

    def kv_table(self, kvs: Sequence[SequenceKV]) -> torch.Tensor | None:
        return None

    def twin_runs(self, ops: Sequence[str]) -> list[int]:
        """How often each of `ops` has run a twin in place of a fused kernel; these ops have no fused kernels."""
        return []

    def attention(self, layer: int, q: torch.Tensor, positions: torch.Tensor, kvs: Sequence[SequenceKV],
                  table: torch.Tensor | None = None, capacity: int | None = None) -> torch.Tensor:
        """q [B, H, Dh], row b at positions[b] of kvs[b], against that cache's positions 0..positions[b]
        of layer `layer` -> [B, H, Dh]. Here: the whole capacity under a mask, a paged cache's cells
        gathered through its block table (a Q8_0 cache dequantized first, as the kernel's tile loads do)."""
        outs = []
        for b, kv in enumerate(kvs):
            f = kv.format
            k, v = sequence_cells(kv, layer)  # [S, Hkv, row]
            visible = torch.arange(kv.capacity, device=positions.device) <= positions[b]  # [S]
            outs.append(masked_attention(q[b:b + 1], f.load(f.keys, k), f.load(f.values, v), visible))  # [1, H, Dh]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def route(self, h: torch.Tensor, router: torch.Tensor, n_used: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, router, n_used, renormalize)

    def moe_input(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, router: torch.Tensor,
                  n_used: int, renormalize: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """From the residual x and the attention's output y: (x + y, h = rms_norm(x + y), h's routing
        weights [T, A] and experts [T, A], h quantized for integer expert kernels or None)."""
        x, h = self.add_rms_norm(x, y, weight, eps)
        weights, experts = self.route(h, router, n_used, renormalize)
        return x, h, weights, experts, None


PLAIN_OPS = DecodeOps()  # stateless: one instance serves every decoder's prompt path
