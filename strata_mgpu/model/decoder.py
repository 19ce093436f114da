"""The Qwen3-MoE decoder forward, written once: the oracle (`model.reference`) and every GPU stage
run this same code.

Shape legend: T = token rows in the batch, t = rows of a part of it, D = hidden, H = query heads,
Hkv = KV heads, Dh = head dim, E = experts, A = experts used per token, V = vocab, S = keys.

One batch packs several sequences along T (`Segment`s): a prefill is one segment of many rows,
a decode step one row per running sequence. Everything but attention runs on all rows at once.
What differs between forwards is the path (`ForwardPath`), chosen once per call: segment
attention (SDPA, prompts) or row attention (the decode step's fused ops, capturable as a CUDA
graph); all rows at once or a helped prompt's two halves; experts streamed or gathered.

A hybrid model's layer mixes tokens by full attention or by gated DeltaNet (`model.delta_net`); the
latter's state lives beside each sequence's KV (`Segment.linear`: a slot of the decoder's
`StatePool`), whose cache holds only the full-attention layers (`Decoder.kv_slot`). Such models'
forwards take the segment path (a decode step's DeltaNet rows stepped together by slot); their
decode graphs capture `step_static` (`GatedRowAttention`, the rows' state slots as a tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.delta_net import (
    DeltaScan,
    causal_conv,
    conv_step,
    delta_heads,
    delta_rule,
    delta_rule_chunked,
    delta_step,
    gated_norm,
)
from strata_mgpu.model.expert_backend import ExpertBackend
from strata_mgpu.model.glm4moe import route_sigmoid
from strata_mgpu.model.gpt_oss import route_topk_softmax, sink_attention
from strata_mgpu.model.kv_cache import PLAIN_KV, KVCache, KVFormat, SequenceKV
from strata_mgpu.model.linear_state import LinearState
from strata_mgpu.model.ops import PLAIN_OPS, DecodeOps, causal_attention, qk_norm_rope, rms_norm, rope_cos_sin
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.state_pool import StatePool
from strata_mgpu.model.weights import (
    BlockMatrix,
    DeltaNetWeights,
    LayerWeights,
    Matrix,
    ModelWeights,
    SharedExpertWeights,
)
from strata_mgpu.quant.dequant import dequantize_rows

# (local layer, h [T, D], router [E, D]) -> (weights [T, A] fp32, experts [T, A])
Routing = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DenseMatmul(Protocol):
    """How a forward multiplies its projections: x [T, K] and W [N, K] -> x @ W.T [T, N] in x's
    dtype. A stage whose projections are blocks (`BlockMatrix`) passes what multiplies those."""

    def __call__(self, x: torch.Tensor, w: Matrix) -> torch.Tensor: ...

    def many(self, x: torch.Tensor, ws: Sequence[Matrix]) -> list[torch.Tensor]:
        """x times each of `ws`, x's preparation (e.g. its quantization) done once."""
        return [self(x, w) for w in ws]


class FloatMatmul(DenseMatmul):
    """x [T, K] @ W.T for a float W [N, K] (the decoder's default)."""

    def __call__(self, x: torch.Tensor, w: Matrix) -> torch.Tensor:
        if isinstance(w, BlockMatrix):
            raise TypeError("a projection kept as blocks needs the stage's DenseMatmul")
        return x @ w.T


float_matmul = FloatMatmul()


@dataclass
class Segment:
    """Rows [start, end) of the batch belong to the sequence whose cache is `kv`."""

    start: int
    end: int
    kv: SequenceKV
    linear: LinearState | None = None  # its DeltaNet state, where the decoder has linear layers

    @property
    def n(self) -> int:
        return self.end - self.start


@dataclass
class Rows:
    """Rows the layer loop carries through the layers on their own: every row of the forward, or one
    of a helped prompt's two halves."""

    x: torch.Tensor  # [t, D]: the residual stream
    rows: slice  # which of the forward's rows
    segments: Sequence[Segment]  # their sequences, rows counted from the first of these
    at: int = 0  # where they sit past each sequence's cached cells (a second half: after the first)
    pending: torch.Tensor | None = None  # the last layer's `experts.start`, added at the next layer


class Attention(Protocol):
    def __call__(self, i: int, w: LayerWeights, h: torch.Tensor, part: Rows) -> torch.Tensor:
        """Layer i's attention for `part`'s normed rows h [t, D], projected by wo: [t, D]. Writes the
        rows' keys and values into their caches."""
        ...


class SegmentAttention:
    """A prompt's attention: each segment's keys and values written after its cached ones, then SDPA
    over them, a segment at a time (a gpt-oss layer: its biases added, and `sink_attention` over its
    window). Every cache's layer i + 1 is prefetched before layer i attends."""

    def __init__(self, spec: ModelSpec, cos: torch.Tensor, sin: torch.Tensor, dense: DenseMatmul = float_matmul):
        self.spec, self.cos, self.sin, self.dense = spec, cos, sin, dense  # cos, sin [T, Dh] each

    def __call__(self, i: int, w: LayerWeights, h: torch.Tensor, part: Rows) -> torch.Tensor:
        s, mm = self.spec, self.dense
        assert w.wq is not None and w.wk is not None and w.wv is not None and w.wo is not None, "an attention layer"
        if isinstance(w.wqkv, BlockMatrix):  # blocks: one product rather than three calls into the kernels
            q, k, v = mm(h, w.wqkv).split([s.q_proj_dim, s.kv_dim, s.kv_dim], dim=1)
        else:
            q, k, v = mm.many(h, (w.wq, w.wk, w.wv))
        oss = w.oss
        if oss is not None:
            q, k, v = q + oss.bq, k + oss.bk, v + oss.bv
        elif w.bq is not None and w.bk is not None and w.bv is not None:  # glm4moe's biases
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        gate = None
        if s.attn_output_gate:  # [t, H, 2 Dh]: each head's query, then its gate
            q, gate = q.reshape(h.shape[0], s.n_heads, 2 * s.head_dim).split(s.head_dim, dim=2)
            q, gate = q.reshape(h.shape[0], s.q_dim), gate.reshape(h.shape[0], s.q_dim)
        q, k = qk_norm_rope(s, w, q, k, self.cos[part.rows], self.sin[part.rows])
        v = v.reshape(h.shape[0], s.n_kv_heads, s.head_dim)
        for seg in part.segments:  # layer i + 1's keys arrive while layer i attends and runs its experts
            seg.kv.prefetch(i + 1)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return causal_attention(q, k, v) if oss is None else sink_attention(q, k, v, oss.sinks, oss.window)

        if len(part.segments) == 1:
            out = attend(q, *part.segments[0].kv.write(i, k, v, at=part.at))  # [t, H, Dh]
        else:
            out = torch.empty_like(q)
            for seg in part.segments:
                rows = slice(seg.start, seg.end)
                k_all, v_all = seg.kv.write(i, k[rows], v[rows], at=part.at)  # [S, Hkv, Dh]
                out[rows] = attend(q[rows], k_all, v_all)
        attended = out.reshape(-1, s.q_dim)
        projected = mm(attended if gate is None else attended * torch.sigmoid(gate), w.wo)
        return projected if oss is None else projected + oss.bo


class RowAttention:
    """The decode step's attention: each row's keys and values written at positions[b] of its own
    cache kvs[b] (every row's before any row attends), then each row attends its cache up to its
    position. Rows may share a cache at different positions: causal within it, as SDPA's mask is.
    Every shape and address is fixed, so the step can be captured as a CUDA graph. `table`: the
    caches' addresses as the fused ops read them; `capacity`: cells covered, above every position read."""

    def __init__(self, spec: ModelSpec, ops: DecodeOps, positions: torch.Tensor, kvs: Sequence[SequenceKV],
                 table: torch.Tensor | None, capacity: int | None, cos: torch.Tensor, sin: torch.Tensor,
                 dense: DenseMatmul = float_matmul):
        self.spec, self.ops, self.positions, self.kvs = spec, ops, positions, kvs
        self.table, self.capacity, self.cos, self.sin, self.dense = table, capacity, cos, sin, dense

    def __call__(self, i: int, w: LayerWeights, h: torch.Tensor, part: Rows) -> torch.Tensor:
        s, mm = self.spec, self.dense
        assert w.wq is not None and w.wk is not None and w.wv is not None and w.wo is not None, "an attention layer"
        if w.wqkv is not None:  # one GEMM: [B, (H + 2 Hkv) * Dh], split into column blocks
            q, k, v = mm(h, w.wqkv).split([s.q_dim, s.kv_dim, s.kv_dim], dim=1)
        else:  # made apart (blocks of different types): h prepared once for the three
            q, k, v = mm.many(h, (w.wq, w.wk, w.wv))
        q = self.ops.qk_norm_rope_kv(s, w, i, q, k, v, self.positions, self.cos, self.sin, self.kvs,
                                     self.table)  # [B, H, Dh]
        out = self.ops.attention(i, q, self.positions, self.kvs, self.table, self.capacity)  # [B, H, Dh]
        return mm(out.reshape(h.shape[0], s.q_dim), w.wo)


@dataclass(frozen=True)
class ForwardPath:
    """How one forward runs, chosen once per call."""

    ops: DecodeOps  # the norms, and the MoE block's input where `fused_moe_input`
    attention: Attention
    fused_moe_input: bool  # the residual add, norm, routing and quantized input in one op (ops.moe_input)
    streams: bool  # the experts stream whole layers (else the rows' picks are gathered)
    halves: bool = False  # two halves of one sequence's rows
    prefetched: tuple[SequenceKV, ...] = ()  # caches whose cells elsewhere come up a layer ahead
    slots: torch.Tensor | None = None  # a static step's DeltaNet state slots [B] (`step_static`'s)


# Cells the row path may read again: it attends row by row, so each of a segment's rows past its
# first reads the sequence's cache once more (SDPA reads it about once). Past this many (rows x
# cells, e.g. 64 rows after 4K cells), a forward takes the segment path: the extra reads would cost
# more than the host time the fused ops save (docs/ARCHITECTURE.md).
STATIC_REREAD_CELLS = 1 << 18


class Decoder:
    """The decoder forward over dense weights (any dtype, any device) and an expert backend.

    `static_rows`: forwards of few rows take the row path where they may (`_takes_static`); on for
    a GPU stage with fused ops, since there launches, not the GPU, bound a short prompt; off where
    the fused kernels do not serve the spec's layers (`ModelSpec.fused_attention`: hybrid models).
    `routing`: where set, replaces every layer's routing (tests record or force it).
    `dense`: what multiplies the projections (`DenseMatmul`); `delta_scan`: a prompt's DeltaNet scan.
    `state_slots`: a hybrid model's sequences whose DeltaNet state its `StatePool` holds at once (a
    stage's --max-running; None: as many as are made, the reference's).
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights, experts: ExpertBackend, ops: DecodeOps | None = None,
                 static_rows: bool = False, kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV,
                 dense: DenseMatmul = float_matmul, delta_scan: DeltaScan = delta_rule_chunked,
                 state_slots: int | None = None):
        self.spec = spec
        self.delta_scan = delta_scan  # a prompt's DeltaNet rows (a GPU stage's: fla's kernels where installed)
        self.w = weights
        self.dense = dense
        self.kv_format = KVFormat(weights.dtype, *kv_types)  # how its caches store keys and values
        self.experts = experts
        self.ops = ops or DecodeOps()
        self.static_rows = static_rows and spec.fused_attention
        self.routing: Routing | None = None
        # layer -> its slot in a sequence's KV cache (full-attention layers only); its linear layers
        self.kv_slot = [sum(lw.delta is None for lw in weights.layers[:i]) for i in range(len(weights.layers))]
        self.linear_layers = [i for i, lw in enumerate(weights.layers) if lw.delta is not None]
        # every sequence's DeltaNet state, by slot (None without linear layers)
        self.states = (StatePool(spec.delta, self.linear_layers, state_slots, self.device, weights.dtype)
                       if self.linear_layers and spec.delta is not None else None)
        # one-row segments' DeltaNet steps gathered by slot, all at once (False: a segment at a time,
        # the plain twin tests compare against)
        self.batched_linear_steps = True

    @property
    def device(self) -> torch.device:
        return self.w.device

    def new_cache(self, max_length: int, capacity: int = 256) -> KVCache:
        s = self.spec
        f = self.kv_format
        return KVCache(self.n_kv_layers, s.n_kv_heads, s.head_dim, capacity=capacity, max_length=max_length,
                       device=self.device, dtype=f.dtype, keys=f.keys, values=f.values)

    @property
    def n_kv_layers(self) -> int:
        """Layers a sequence's KV cache holds: the full-attention ones."""
        return len(self.w.layers) - len(self.linear_layers)

    def new_linear_state(self, snapshots_on: torch.device | None = None) -> LinearState | None:
        """A fresh sequence's DeltaNet state for this decoder's linear layers (its snapshots kept on
        `snapshots_on`, `LinearState`'s); None where it has none."""
        if self.states is None:
            return None
        return LinearState(self.states, snapshots_on)

    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """tokens [T] (sequences packed as `segments`) -> final hidden states [T, D]."""
        return self.run(self.embed(tokens), segments)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.w.embed
        assert table is not None, "only the first stage embeds"
        if isinstance(table, BlockMatrix):  # the picked rows' blocks, dequantized
            return dequantize_rows(table.raw[tokens], table.ggml_type, table.k).to(self.w.dtype)  # [T, D]
        return table[tokens]  # [T, D]

    def run(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """This decoder's layers over hidden rows x [T, D] -> [T, D] (x may be overwritten). Each
        segment's rows continue its sequence at `kv.length`; caches advance afterwards."""
        for seg in segments:
            seg.kv.reserve(seg.n)
            if self.linear_layers and (seg.linear is None or seg.linear.length != seg.kv.length):
                raise ValueError("a hybrid model's sequence needs its DeltaNet state at its KV's length")
        positions = torch.cat([torch.arange(seg.kv.length, seg.kv.length + seg.n, device=x.device)
                               for seg in segments])  # [T]
        n = x.shape[0]
        streams = self.experts.should_stream(n)
        if self._takes_static(n, segments, streams):
            # row r of a segment: its sequence's cache at position kv.length + r
            kvs = [seg.kv for seg in segments for _ in range(seg.n)]  # [T], a segment's cache repeated
            cells = max(seg.kv.length + seg.n for seg in segments)  # what attention reads, at most
            path = self._row_path(positions, kvs, None, cells, streams)
        else:
            cos, sin = rope_cos_sin(positions, self.spec, self.w.dtype)  # [T, Dh]
            halves = (streams and len(segments) == 1 and segments[0].kv.offset_writes and n >= 2
                      and self.experts.in_halves(n))
            path = ForwardPath(ops=PLAIN_OPS, attention=SegmentAttention(self.spec, cos, sin, self.dense),
                               fused_moe_input=False,
                               streams=streams, halves=halves, prefetched=tuple(seg.kv for seg in segments))
        x = self._layers(x, segments, path)
        for seg in segments:
            seg.kv.advance(seg.n)
            if seg.linear is not None:
                seg.linear.advance(seg.n)
        return x

    def _takes_static(self, n_rows: int, segments: Sequence[Segment], streams: bool) -> bool:
        """May this forward, its caches reserved, take the row path? Only where every cache holds each
        cell, the new ones included, at its own position (`graph_capturable`); the rows gather their
        experts (streaming needs the segment path's ring); and the rows' repeated cache reads stay
        within STATIC_REREAD_CELLS (past that, SDPA's shared keys win: docs/ARCHITECTURE.md)."""
        if not self.static_rows or streams:
            return False
        if not all(seg.kv.graph_capturable and seg.kv.length + seg.n <= seg.kv.capacity for seg in segments):
            return False
        return sum((seg.n - 1) * (seg.kv.length + seg.n) for seg in segments) <= STATIC_REREAD_CELLS

    def _row_path(self, positions: torch.Tensor, kvs: Sequence[SequenceKV], table: torch.Tensor | None,
                  capacity: int | None, streams: bool) -> ForwardPath:
        assert all(kv.graph_capturable for kv in kvs), "a cache keeps cells outside kv.k/kv.v: decode it with run()"
        assert self.spec.fused_attention, "the fused decode ops do not serve this model's layers: decode it with run()"
        s = self.spec
        cos, sin = rope_cos_sin(positions, s, self.w.dtype)  # [B, Dh]
        table = self.ops.kv_table(kvs) if table is None else table
        attention = RowAttention(s, self.ops, positions, kvs, table, capacity, cos, sin, self.dense)
        return ForwardPath(ops=self.ops, attention=attention, fused_moe_input=True, streams=streams)

    def _layers(self, x: torch.Tensor, segments: Sequence[Segment], path: ForwardPath) -> torch.Tensor:
        """Every layer over x [T, D] on `path`. Where the forward fails, the caches' copies in flight are
        drained and the experts' pass given back."""
        try:
            for kv in path.prefetched:
                kv.prefetch(0)
            self.experts.begin(x.shape[0], stream=path.streams)
            parts = self._parts(x, segments, path.halves)
            for i, layer in enumerate(self.w.layers):
                for j, part in enumerate(parts):
                    self._layer(i, layer, part, path, first=j == 0)
            outs = []
            for part in parts:  # pending None: the last layer was dense
                outs.append(part.x if part.pending is None else part.x + self.experts.finish(part.pending))
        except BaseException:
            for kv in path.prefetched:  # no upload may still run into a buffer someone else uses next
                kv.drain()
            self.experts.abort()
            raise
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _parts(x: torch.Tensor, segments: Sequence[Segment], halves: bool) -> list[Rows]:
        """All rows at once, or one sequence's rows in two halves: the second attends after the first's
        keys, as causal attention over all rows would."""
        if not halves:
            return [Rows(x, slice(0, x.shape[0]), segments)]
        kv, linear, n = segments[0].kv, segments[0].linear, x.shape[0]
        cut = n // 2
        return [Rows(x[:cut], slice(0, cut), [Segment(0, cut, kv, linear)]),
                Rows(x[cut:], slice(cut, n), [Segment(0, n - cut, kv, linear)], at=cut)]

    def _layer(self, i: int, w: LayerWeights, part: Rows, path: ForwardPath, first: bool) -> None:
        """Layer i over `part`: the last layer's expert output added (its helper's part collected now),
        attention, the MoE block's input and routing, and the experts started."""
        s, ops = self.spec, path.ops
        if part.pending is None:
            h = ops.rms_norm(part.x, w.attn_norm, s.rms_eps)
        else:
            part.x, h = ops.add_rms_norm(part.x, self.experts.finish(part.pending), w.attn_norm, s.rms_eps)
        if w.delta is not None:
            attended = self._delta_net(i, w.delta, h, part, path.slots)
        else:
            attended = path.attention(self.kv_slot[i], w, h, part)
        if w.mlp is not None:  # a dense layer: its FFN in place of the MoE block, no experts started
            part.x, h = ops.add_rms_norm(part.x, attended, w.ffn_norm, s.rms_eps)
            part.x, part.pending = part.x + self._shared_expert(w.mlp, h), None
            return
        assert w.router is not None, "a MoE layer has its router"
        hq = None
        if path.fused_moe_input and self.routing is None:  # add, norm, routing, quantized input: one launch
            part.x, h, weights, experts, hq = ops.moe_input(part.x, attended, w.ffn_norm, s.rms_eps, w.router,
                                                            s.n_experts_used, s.norm_topk_prob)
        else:
            part.x, h = ops.add_rms_norm(part.x, attended, w.ffn_norm, s.rms_eps)
            weights, experts = self.routing(i, h, w.router) if self.routing is not None else self.route(i, h, w.router)
        part.pending = self.experts.start(i, h, weights, experts, hq=hq, first=first)
        if w.shared is not None:  # dense, beside the routed experts' pass
            part.x = part.x + self._shared_expert(w.shared, h)

    def _delta_net(self, i: int, w: DeltaNetWeights, h: torch.Tensor, part: Rows,
                   slots: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's gated DeltaNet over `part`'s normed rows h [t, D], projected by its out: [t, D].
        Each segment's rows continue (and update in place) its sequence's state. Where every segment is
        one row (a decode step; `slots` [t]: a static step's, row r continuing slot slots[r]) all rows
        step at once, their states gathered by slot (`_delta_rows`); else a segment at a time, in
        pieces cut at the boundaries its state marked (`LinearState.mark`), where the state is recorded."""
        s, mm = self.spec, self.dense
        assert s.delta is not None
        d, t = s.delta, h.shape[0]
        qkv, z = mm.many(h, (w.wqkv, w.wz))  # [t, C], [t, Hv Dv]
        a, b = h @ w.w_alpha.T, h @ w.w_beta.T  # [t, Hv] each
        if slots is None and self.batched_linear_steps and part.at == 0 and all(seg.n == 1 for seg in part.segments):
            assert self.states is not None
            slots = self.states.rows([self._linear(seg).slot for seg in part.segments])  # [t]
        if slots is not None:
            out = self._delta_rows(i, w, qkv, a, b, slots).to(h.dtype)
            for seg in part.segments:  # a boundary marked right after this row: the state it ends with
                linear = self._linear(seg)
                if linear.cuts(linear.length, 1):
                    linear.record(linear.length + 1, i)
        else:
            out = torch.empty(t, d.n_v_heads, d.v_head_dim, device=h.device, dtype=h.dtype)
            for seg in part.segments:
                linear = self._linear(seg)
                state, first = linear.layer(i), linear.length + part.at  # views of its slot; the segment's first token
                cuts = linear.cuts(first, seg.n)
                for lo, hi in zip([0, *cuts], [*cuts, seg.n], strict=True):
                    if lo == hi:
                        continue
                    rows = slice(seg.start + lo, seg.start + hi)
                    conv, new_conv = causal_conv(qkv[rows], state.conv, w.conv)  # [n, C]
                    state.conv.copy_(new_conv)
                    q, k, v, g, beta = delta_heads(d, conv, a[rows], b[rows], w.dt_bias, w.decay_rate, w.key_heads)
                    o, new_recurrent = delta_rule(q, k, v, g, beta, state.recurrent, self.delta_scan)  # [n, Hv, Dv]
                    state.recurrent.copy_(new_recurrent)
                    out[rows] = o.to(h.dtype)
                    if hi in cuts:
                        linear.record(first + hi, i)
        normed = gated_norm(out, z.view(t, d.n_v_heads, d.v_head_dim), w.norm, s.rms_eps)
        return mm(normed.reshape(t, d.value_dim), w.wout)

    @staticmethod
    def _linear(seg: Segment) -> LinearState:
        assert seg.linear is not None, "a hybrid model's segment carries its DeltaNet state"
        return seg.linear

    def _delta_rows(self, i: int, w: DeltaNetWeights, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
        """One token of B sequences through layer i's conv and delta rule: qkv [B, C], a, b [B, Hv], row r's
        state in slot slots[r] of the pool, gathered, stepped and written back in place (no host sync:
        a graph captures it) -> out [B, Hv, Dv] fp32."""
        pool, d = self.states, self.spec.delta
        assert pool is not None and d is not None and slots.shape[0] == qkv.shape[0]
        conv, new_conv = conv_step(qkv, pool.conv[i].index_select(0, slots), w.conv)  # [B, C], [B, C, K - 1]
        pool.conv[i].index_copy_(0, slots, new_conv.to(pool.dtype))
        q, k, v, g, beta = delta_heads(d, conv, a, b, w.dt_bias, w.decay_rate, w.key_heads)
        out, recurrent = delta_step(q, k, v, g, beta, pool.recurrent[i].index_select(0, slots))  # [B, Hv, Dk, Dv]
        pool.recurrent[i].index_copy_(0, slots, recurrent)
        return out

    def _shared_expert(self, w: SharedExpertWeights, h: torch.Tensor) -> torch.Tensor:
        """h [t, D] -> sigmoid(h . gate_inp) * down(silu(gate h) * up h): [t, D] (ungated without gate_inp)."""
        g, u = self.dense.many(h, (w.gate, w.up))
        y = self.dense(torch.nn.functional.silu(g) * u, w.down)
        return y if w.gate_inp is None else y * torch.sigmoid(h @ w.gate_inp)[:, None]

    def step_static(self, inp: torch.Tensor, positions: torch.Tensor, kvs: Sequence[SequenceKV],
                    table: torch.Tensor | None = None, capacity: int | None = None,
                    slots: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of B sequences on the row path, every shape and address fixed (what a decode
        graph captures): token ids [B] or hidden rows [B, D] -> logits [B, V] on the last stage, else
        [B, D]. The caller advances the caches (and a hybrid's DeltaNet states). `table`, `capacity`: as
        `RowAttention`'s; `slots` [B] int64: a hybrid model's row b continues the DeltaNet state in slot
        slots[b] of `states` (`LinearState.slot`; `state_pool.SCRATCH` for a pad row), updated in place."""
        x = self.embed(inp) if self.w.embed is not None else inp
        assert x.shape[0] == positions.shape[0] == len(kvs)
        streams = self.experts.should_stream(len(kvs))
        if self.states is not None:
            assert slots is not None and slots.shape == positions.shape, "a hybrid step names its rows' state slots"
            path = self._gated_row_path(positions, kvs, table, capacity, streams, slots)
        else:
            path = self._row_path(positions, kvs, table, capacity, streams)
        x = self._layers(x, [], path)
        return self.logits(x) if self.w.output is not None else x

    def _gated_row_path(self, positions: torch.Tensor, kvs: Sequence[SequenceKV], table: torch.Tensor | None,
                        capacity: int | None, streams: bool, slots: torch.Tensor) -> ForwardPath:
        """A hybrid model's static step: its attention layers by `GatedRowAttention`, its DeltaNet layers
        on the rows' state slots."""
        assert all(kv.graph_capturable for kv in kvs), "a cache keeps cells outside kv.k/kv.v: decode it with run()"
        cos, sin = rope_cos_sin(positions, self.spec, self.w.dtype)  # [B, R]
        table = self.ops.kv_table(kvs) if table is None else table
        attention = GatedRowAttention(self.spec, self.ops, positions, kvs, table, capacity, cos, sin, self.dense)
        return ForwardPath(ops=self.ops, attention=attention, fused_moe_input=True, streams=streams, slots=slots)

    def route(self, i: int, h: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's own routing: (weights [T, A] fp32, experts [T, A]); a gpt-oss layer's through its
        router's bias, a glm4moe layer's sigmoid scores through its choice bias (exp_probs_b)."""
        s, lw = self.spec, self.w.layers[i]
        if lw.oss is not None:
            return route_topk_softmax(h, router, lw.oss.router_bias, s.n_experts_used)
        if s.sigmoid_routing is not None:
            assert lw.expert_bias is not None, "a sigmoid-routed layer has its expert bias"
            return route_sigmoid(h, router, lw.expert_bias, s.n_experts_used, s.sigmoid_routing)
        return self.ops.route(h, router, s.n_experts_used, s.norm_topk_prob)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] final hidden rows -> [N, V] logits."""
        assert self.w.output is not None and self.w.out_norm is not None, "only the last stage has the head"
        return self.dense(rms_norm(hidden, self.w.out_norm, self.spec.rms_eps), self.w.output)

    def prefill(self, tokens: torch.Tensor, kv: SequenceKV, linear: LinearState | None = None) -> torch.Tensor:
        """All-position logits [T, V] of one sequence's new tokens (`linear`: its DeltaNet state)."""
        return self.logits(self.forward(tokens, [Segment(0, tokens.shape[0], kv, linear)]))


class GatedRowAttention(RowAttention):
    """A hybrid model's attention layers on the decode step's row path (`Decoder.step_static`): as
    `RowAttention`, with each query head's output gate (sigmoid, after attention) where the spec has
    one, and RoPE over the first `rotary_dim` dims of a head (the fused `qk_norm_rope_kv` takes the
    rotated dims' tables)."""

    def __call__(self, i: int, w: LayerWeights, h: torch.Tensor, part: Rows) -> torch.Tensor:
        s, mm, n = self.spec, self.dense, h.shape[0]
        assert w.wq is not None and w.wk is not None and w.wv is not None and w.wo is not None, "an attention layer"
        if w.wqkv is not None:  # one GEMM: [B, q_proj_dim + 2 Hkv Dh], split into column blocks
            q, k, v = mm(h, w.wqkv).split([s.q_proj_dim, s.kv_dim, s.kv_dim], dim=1)
        else:
            q, k, v = mm.many(h, (w.wq, w.wk, w.wv))
        gate = None
        if s.attn_output_gate:  # [B, H, 2 Dh]: each head's query, then its gate (copied out contiguous)
            q, gate = q.reshape(n, s.n_heads, 2 * s.head_dim).split(s.head_dim, dim=2)
            q, gate = q.reshape(n, s.q_dim), gate.reshape(n, s.q_dim)
        q = self.ops.qk_norm_rope_kv(s, w, i, q, k, v, self.positions, self.cos, self.sin, self.kvs,
                                     self.table)  # [B, H, Dh]
        out = self.ops.attention(i, q, self.positions, self.kvs, self.table, self.capacity)  # [B, H, Dh]
        attended = out.reshape(n, s.q_dim)
        return mm(attended if gate is None else attended * torch.sigmoid(gate), w.wo)
