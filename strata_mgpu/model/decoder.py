"""The Qwen3-MoE decoder forward, written once: the oracle (`model.reference`) and every GPU stage
run this same code.

Shape legend: T = token rows in the batch, D = hidden, H = query heads, Hkv = KV heads,
Dh = head dim, E = experts, A = experts used per token, F = expert width, V = vocab, S = keys.

One batch packs several sequences along T (`Segment`s): a prefill is one segment of many rows,
a decode step is one row for each running sequence. Everything but attention runs on all rows
at once; attention runs per segment against that sequence's KV cache.

What differs between devices is the routed experts: `Decoder` takes an `ExpertBackend`.
`DenseExperts` (`model.reference`) computes them from dequantized tensors; the GPU stage streams
them from pinned host memory (`stage.streamed_experts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from strata_mgpu.model.kv_cache import KVCache
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.weights import LayerWeights, ModelWeights


@dataclass
class Segment:
    """Rows [start, end) of the batch belong to the sequence whose cache is `kv`."""

    start: int
    end: int
    kv: KVCache

    @property
    def n(self) -> int:
        return self.end - self.start


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in fp32, cast back, then scaled (as transformers does)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """NEOX-style rotary tables: [T, Dh] each (the half-frequencies repeated)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh]: rotate the two halves of each head (NEOX / HF rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qk_norm_rope(spec: ModelSpec, w: LayerWeights, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Projections q [T, H*Dh], k [T, Hkv*Dh] -> q [T, H, Dh], k [T, Hkv, Dh], each head RMS-normed
    and rotated."""
    t = q.shape[0]
    q = rms_norm(q.view(t, spec.n_heads, spec.head_dim), w.q_norm, spec.rms_eps)
    k = rms_norm(k.view(t, spec.n_kv_heads, spec.head_dim), w.k_norm, spec.rms_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


# cuDNN's attention builds a graph per new shape: about 1 ms of CPU per call in decode, where the
# key count grows every step (seen on the H200 with torch 2.11). Flash, memory-efficient or math
# kernels serve every shape here.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, Dh] are the last T positions of k, v [S, Hkv, Dh]; returns [T, H, Dh]."""
    with sdpa_kernel(SDPA_BACKENDS):
        return _sdpa(q, k, v)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t, s = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if t == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    elif t == 1:  # one new token sees every key: no mask (a mask would send SDPA to a slower kernel)
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    else:  # a chunk after a prefix: query i sits at key s - t + i and sees keys 0..s-t+i.
        # A lower-right causal bias keeps the flash/efficient kernels (an explicit [T, S] mask sent
        # GQA to the math kernel, which wanted 16 GiB of scores for an 8K chunk after 16K keys);
        # they take no GQA flag, so the KV heads are repeated for this call.
        group = q.shape[1] // k.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, s))
    return out[0].transpose(0, 1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [T, H, Dh] against all of k, v [S, Hkv, Dh] where visible [S] (bool) allows; -> [T, H, Dh]."""
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible[None, :], enable_gqa=True)
    return out[0].transpose(0, 1)


def route(h: torch.Tensor, router: torch.Tensor, n_used: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router softmax -> top-k -> renormalize. h [T, D] -> (weights [T, A] fp32, experts [T, A])."""
    probs = torch.softmax(h.float() @ router.float().T, dim=-1)  # [T, E], fp32 whatever h's dtype
    weights, experts = torch.topk(probs, n_used, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


class DecodeOps:
    """The small ops of the static decode step, as plain torch: the twins of the fused CUDA
    versions (`kernels.decode_ops`), which a GPU stage passes to its `Decoder` instead."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, rms_norm(x + y)): the residual stream and the next block's input. The fused
        version updates x in place."""
        x = x + y
        return x, rms_norm(x, weight, eps)

    def qk_norm_rope_kv(self, spec: ModelSpec, w: LayerWeights, layer: int, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        kvs: Sequence[KVCache], table: torch.Tensor | None = None) -> torch.Tensor:
        """B rows, row b one token of sequence kvs[b]: projections q [B, H*Dh], k and v [B, Hkv*Dh].
        q and k normed per head and rotated; row b's k and v written at positions[b] (on the device)
        of layer `layer` of kvs[b]'s cache [capacity, Hkv, Dh]; returns q [B, H, Dh]."""
        qn, kn = qk_norm_rope(spec, w, q, k, cos, sin)
        for b, kv in enumerate(kvs):
            r = slice(b, b + 1)
            kv.k[layer].index_copy_(0, positions[r], kn[r])
            kv.v[layer].index_copy_(0, positions[r], v[r].view(1, spec.n_kv_heads, spec.head_dim))
        return qn

    def kv_table(self, kvs: Sequence[KVCache]) -> torch.Tensor | None:
        """The caches' addresses as fused kernels read them; these ops read the caches themselves."""
        return None

    def attention(self, layer: int, q: torch.Tensor, positions: torch.Tensor, kvs: Sequence[KVCache],
                  table: torch.Tensor | None = None, capacity: int | None = None) -> torch.Tensor:
        """q [B, H, Dh], row b the token at positions[b] of kvs[b], against that cache's cells
        0..positions[b] of layer `layer` -> [B, H, Dh]. Here: the whole capacity under a mask."""
        outs = []
        for b, kv in enumerate(kvs):
            visible = torch.arange(kv.capacity, device=positions.device) <= positions[b]  # [S]
            outs.append(masked_attention(q[b:b + 1], kv.k[layer], kv.v[layer], visible))  # [1, H, Dh]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def route(self, h: torch.Tensor, router: torch.Tensor, n_used: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, router, n_used, renormalize)

    def moe_input(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, router: torch.Tensor,
                  n_used: int, renormalize: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The MoE block's input from the residual x and the attention's output y: (x + y, h =
        rms_norm(x + y), h's routing weights [T, A] and experts [T, A], and h quantized for integer
        expert kernels or None). The twin: add_rms_norm, then route; nothing quantized."""
        x, h = self.add_rms_norm(x, y, weight, eps)
        weights, experts = self.route(h, router, n_used, renormalize)
        return x, h, weights, experts, None


class ExpertBackend(Protocol):
    """Computes a layer's routed experts for the rows routed to them."""

    def begin(self, n_rows: int) -> None:
        """A forward over n_rows token rows starts (a streaming backend starts its uploads)."""
        ...

    def forward(self, layer: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                hq: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, D], router weights [T, A] fp32, expert ids [T, A] -> weighted expert outputs [T, D].
        hq: h already quantized for integer expert kernels (`DecodeOps.moe_input`), or None."""
        ...


# Cells the static path may read again: `layers_static` attends row by row, so each of a segment's
# rows past its first reads the sequence's cache once more (run's SDPA reads it about once). Past
# this many (rows x cells, e.g. 64 rows after 4K cells), a forward takes run's path. 30B-A3B:
# 2 KiB of keys and values a cell and layer, so at most ~25 GB of extra reads over 48 layers (~5 ms on
# an H200) against the ~20 ms of host time a 16-row prompt saves there.
STATIC_REREAD_CELLS = 1 << 18


class Decoder:
    """The decoder forward over dense weights (any dtype, any device) and an expert backend.

    `static_rows`: forwards of few rows take the static decode step's ops (`layers_static`) where
    they may (`_takes_static`). Off by default (the fp32 reference keeps `run`'s path); a GPU stage
    whose `ops` are the fused ones turns it on, since there `run`'s ~30 launches a layer, not the
    GPU, bound a short prompt and the fused ops take ~11."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, experts: ExpertBackend, ops: DecodeOps | None = None):
        self.spec = spec
        self.w = weights
        self.experts = experts
        self.ops = ops or DecodeOps()
        self.static_rows = False

    @property
    def device(self) -> torch.device:
        return self.w.device

    def new_cache(self, max_length: int, capacity: int = 256) -> KVCache:
        s = self.spec
        return KVCache(len(self.w.layers), s.n_kv_heads, s.head_dim, capacity=capacity, max_length=max_length,
                       device=self.device, dtype=self.w.dtype)

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """tokens [T] (sequences packed as `segments`) -> final hidden states [T, D]."""
        return self.run(self.embed(tokens), segments)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.w.embed is not None, "only the first stage embeds"
        return self.w.embed[tokens]  # [T, D]

    def run(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """This decoder's layers over hidden rows x [T, D] -> [T, D] (x may be overwritten).

        Each segment's rows continue its sequence at `kv.length`; caches advance afterwards.
        With `static_rows` on, a forward that may goes through `layers_static` (`_takes_static`).
        A cache with part of its keys elsewhere (`stage.host_kv`) has `prefetch(layer)`, called one
        layer ahead of its attention, and `drain()`, called if the forward fails.
        """
        for seg in segments:
            seg.kv.reserve(seg.n)
        positions = torch.cat([torch.arange(seg.kv.length, seg.kv.length + seg.n, device=x.device)
                               for seg in segments])  # [T]
        if self._takes_static(x.shape[0], segments):
            # row r of a segment: its sequence's cache at position kv.length + r. qk_norm_rope_kv
            # writes every row's keys and values before attention reads any cache, each row up to
            # its own position: causal within a segment as SDPA's mask is.
            kvs = [seg.kv for seg in segments for _ in range(seg.n)]  # [T], a segment's cache repeated
            cells = max(seg.kv.length + seg.n for seg in segments)  # what attention reads, at most
            x = self.layers_static(x, positions, kvs, capacity=cells)
        else:
            x = self._run_eager(x, segments, positions)
        for seg in segments:
            seg.kv.advance(seg.n)
        return x

    def _takes_static(self, n_rows: int, segments: Sequence[Segment]) -> bool:
        """May (and should) this forward, its caches reserved, go through `layers_static`? Where
        `static_rows` is on; every cache holds each of its cells, the new ones included, in
        `kv.k`/`kv.v` at its own position (`graph_capturable`, and the new rows within the
        capacity: a two-tier cache that has spilled, or whose rows would leave its VRAM window,
        keeps run's path and its prefetch); the rows gather their experts (a pass that streams
        needs `run`'s ring and helper; a whole-layer pass over experts all resident would not, but
        on the H200 the 8 chats' pack of ~1,080 picks took 151 ms this way against 120 on `run`'s
        path, and a 512-token prompt 145 against 85: the decode attention reads each row's cache
        on its own, where SDPA shares a segment's keys); and the rows' repeated reads of their
        caches stay within STATIC_REREAD_CELLS."""
        if not self.static_rows:
            return False
        if not all(seg.kv.graph_capturable and seg.kv.length + seg.n <= seg.kv.capacity for seg in segments):
            return False
        should_stream = getattr(self.experts, "should_stream", None)  # the reference's experts never stream
        if should_stream is not None and should_stream(n_rows):
            return False
        return sum((seg.n - 1) * (seg.kv.length + seg.n) for seg in segments) <= STATIC_REREAD_CELLS

    def _run_eager(self, x: torch.Tensor, segments: Sequence[Segment], positions: torch.Tensor) -> torch.Tensor:
        """`run`'s own path: torch ops over all rows, attention (SDPA) a segment at a time."""
        s = self.spec
        cos, sin = rope_cos_sin(positions, s.head_dim, s.rope_base, self.w.dtype)
        ahead = [seg.kv for seg in segments if hasattr(seg.kv, "prefetch")]
        try:
            for kv in ahead:
                kv.prefetch(0)
            self.experts.begin(x.shape[0])
            if self._in_halves(x.shape[0], segments):
                return self._layers_in_halves(x, segments[0], cos, sin)
            for i, layer in enumerate(self.w.layers):
                q, k, v = self._qkv(layer, rms_norm(x, layer.attn_norm, s.rms_eps), cos, sin)
                for kv in ahead:  # layer i+1's keys arrive while layer i attends and runs its experts
                    kv.prefetch(i + 1)
                out = torch.empty_like(q)
                for seg in segments:
                    rows = slice(seg.start, seg.end)
                    k_all, v_all = seg.kv.write(i, k[rows], v[rows])  # [S, Hkv, Dh]
                    out[rows] = causal_attention(q[rows], k_all, v_all)
                x = x + out.reshape(-1, s.q_dim) @ layer.wo.T
                x = x + self._moe(i, layer, x)
        except BaseException:
            for kv in ahead:  # no upload may still run into a buffer someone else uses next
                kv.drain()
            abort = getattr(self.experts, "abort", None)  # a streaming backend gives back what the pass held
            if abort is not None:
                abort()
            raise
        return x

    def _in_halves(self, n_rows: int, segments: Sequence[Segment]) -> bool:
        """Does this pass (its experts begun) run in two halves of rows? Where the expert backend
        asks for it (a helped pass: `StreamedExperts.in_halves`), over one sequence whose cache
        holds every cell in VRAM (a `KVCache`: a two-tier cache has its own write and prefetch)."""
        in_halves = getattr(self.experts, "in_halves", None)
        return (in_halves is not None and len(segments) == 1 and isinstance(segments[0].kv, KVCache)
                and n_rows >= 2 and in_halves(n_rows))

    def _layers_in_halves(self, x: torch.Tensor, seg: Segment, cos: torch.Tensor, sin: torch.Tensor
                          ) -> torch.Tensor:
        """`_run_eager`'s layers over one sequence's rows x [T, D] in two halves, each layer's halves
        in order (the second attends over the first's keys, as causal attention over all rows
        would). Each half's routed experts start (`experts.start`: handed to the helper, this
        stage's part computed) and finish (the helper's sums added) at the next layer, so between
        a half's hand-over and its sums the stream has the other half's attention and expert rows
        to run. The whole-rows loop's ops on half the rows at a time, but for attention: a half
        after keys of its own sequence (the second, or both after a cached prefix) takes `_sdpa`'s
        path for a chunk after a prefix (its KV heads repeated, a lower-right causal bias)."""
        s = self.spec
        cut = x.shape[0] // 2
        halves = (slice(0, cut), slice(cut, x.shape[0]))
        xs = [x[r] for r in halves]
        pending: list[torch.Tensor | None] = [None, None]  # a half's own partial sums, the helper's to add
        for i, layer in enumerate(self.w.layers):
            for j, rows in enumerate(halves):
                xj = xs[j] if pending[j] is None else xs[j] + self.experts.finish(pending[j])
                q, k, v = self._qkv(layer, rms_norm(xj, layer.attn_norm, s.rms_eps), cos[rows], sin[rows])
                k_all, v_all = seg.kv.write(i, k, v, at=rows.start)
                xj = xj + causal_attention(q, k_all, v_all).reshape(-1, s.q_dim) @ layer.wo.T
                h = rms_norm(xj, layer.ffn_norm, s.rms_eps)
                weights, experts = self.route(i, h, layer.router)
                pending[j] = self.experts.start(i, h, weights, experts, first=j == 0)
                xs[j] = xj
        return torch.cat([xs[j] + self.experts.finish(pending[j]) for j in range(2)])

    def step_static(self, inp: torch.Tensor, positions: torch.Tensor, kvs: Sequence[KVCache],
                    table: torch.Tensor | None = None, capacity: int | None = None) -> torch.Tensor:
        """One decode step of B sequences through this decoder's layers with every shape and
        address fixed (see `layers_static`): token ids [B] where this decoder embeds (the first
        stage), else hidden rows [B, D]; -> logits [B, V] where it holds the head (the last
        stage), else the hidden rows [B, D] for the next stage. What a stage's decode graph captures."""
        x = self.embed(inp) if self.w.embed is not None else inp
        x = self.layers_static(x, positions, kvs, table, capacity)
        return self.logits(x) if self.w.output is not None else x

    def forward_static(self, token: torch.Tensor, position: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """One token [1] of one sequence at a device-held position [1] -> hidden [1, D]."""
        return self.layers_static(self.embed(token), position, [kv])

    def layers_static(self, x: torch.Tensor, positions: torch.Tensor, kvs: Sequence[KVCache],
                      table: torch.Tensor | None = None, capacity: int | None = None) -> torch.Tensor:
        """Hidden rows x [B, D], row b of sequence kvs[b] at the device-held positions[b] -> [B, D].
        `table`: the caches' addresses as the fused ops read them (`ops.kv_table`); made here when
        not given (a captured graph passes its own, rewritten before each replay). `capacity`: cells
        the attention must cover, above every position it will read (a graph's replays may bring
        other caches than its capture's; default: the largest cache of kvs).

        Attention reads each cache up to the positions held on the device (the twin: the whole
        capacity under a mask), and the new keys and values are written there: every shape and
        address is fixed, so the step can be captured once as a CUDA graph and replayed while the
        batch keeps its sequences. The caller advances the caches afterwards. The small ops and
        attention go through `self.ops` (fused on the GPU: a few launches a layer for the whole
        batch). Only for caches whose every cell sits in `kv.k`/`kv.v` at its position
        (`kv.graph_capturable`), and for fewer rows than make the experts stream (`experts.begin`).
        Rows may share a cache at different positions (a prompt's rows, from `run`): every row's keys
        and values are written (`ops.qk_norm_rope_kv`) before any row attends (`ops.attention`).
        """
        assert all(kv.graph_capturable for kv in kvs), "a cache keeps cells outside kv.k/kv.v: decode it with run()"
        s, ops, layers, n = self.spec, self.ops, self.w.layers, len(kvs)
        assert x.shape[0] == positions.shape[0] == n
        cos, sin = rope_cos_sin(positions, s.head_dim, s.rope_base, self.w.dtype)  # [B, Dh]
        table = ops.kv_table(kvs) if table is None else table
        h = ops.rms_norm(x, layers[0].attn_norm, s.rms_eps)
        self.experts.begin(n)
        for i, layer in enumerate(layers):
            if layer.wqkv is not None:  # one GEMM: [B, (H + 2 Hkv) * Dh], split into column blocks
                q, k, v = (h @ layer.wqkv.T).split([s.q_dim, s.kv_dim, s.kv_dim], dim=1)
            else:
                q, k, v = h @ layer.wq.T, h @ layer.wk.T, h @ layer.wv.T
            # each row has its own cache and position
            q = ops.qk_norm_rope_kv(s, layer, i, q, k, v, positions, cos, sin, kvs, table)  # [B, H, Dh]
            out = ops.attention(i, q, positions, kvs, table, capacity)  # [B, H, Dh]
            attended = out.reshape(n, s.q_dim) @ layer.wo.T
            if self._routes_itself:  # norm, routing and the experts' quantized input: one launch on the GPU
                x, h, weights, experts, hq = ops.moe_input(x, attended, layer.ffn_norm, s.rms_eps, layer.router,
                                                           s.n_experts_used, s.norm_topk_prob)
            else:
                x, h = ops.add_rms_norm(x, attended, layer.ffn_norm, s.rms_eps)
                (weights, experts), hq = self.route(i, h, layer.router), None
            y = self.experts.forward(i, h, weights, experts, hq=hq)
            if i + 1 < len(layers):
                x, h = ops.add_rms_norm(x, y, layers[i + 1].attn_norm, s.rms_eps)
            else:
                x = x + y
        return x

    @property
    def _routes_itself(self) -> bool:
        """Is `route` this class's own (so the decode step may route inside `ops.moe_input`)? Tests
        replace it on an instance to record or force the routing: then every layer calls it."""
        return "route" not in vars(self) and type(self).route is _OWN_ROUTE

    def route(self, i: int, h: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's routing: (weights [T, A] fp32, experts [T, A])."""
        return self.ops.route(h, router, self.spec.n_experts_used, self.spec.norm_topk_prob)

    def _qkv(self, w: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed input h [T, D] -> q [T, H, Dh], k and v [T, Hkv, Dh], q/k normed and rotated."""
        s = self.spec
        q, k = qk_norm_rope(s, w, h @ w.wq.T, h @ w.wk.T, cos, sin)
        return q, k, (h @ w.wv.T).view(h.shape[0], s.n_kv_heads, s.head_dim)

    def _moe(self, i: int, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """The routed-expert block of layer i on the residual x [T, D]."""
        h = rms_norm(x, w.ffn_norm, self.spec.rms_eps)
        weights, experts = self.route(i, h, w.router)
        return self.experts.forward(i, h, weights, experts)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] final hidden rows -> [N, V] logits (final norm, then the head)."""
        assert self.w.output is not None and self.w.out_norm is not None, "only the last stage has the head"
        return rms_norm(hidden, self.w.out_norm, self.spec.rms_eps) @ self.w.output.T

    def prefill(self, tokens: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """All-position logits [T, V] of one sequence's new tokens."""
        return self.logits(self.forward(tokens, [Segment(0, tokens.shape[0], kv)]))


_OWN_ROUTE = Decoder.route  # what `Decoder._routes_itself` compares with, however the class is patched later
