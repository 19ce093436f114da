"""One VRAM plan per stage: what the budget holds, line by line, resident experts with the rest.

A stage's `--max-vram` is one pool. Fixed lines come first (dense weights, one layer's experts as
bf16, one chunk's activation peak, KV, a hybrid model's DeltaNet state of every running sequence,
decode's graphs and workspaces, allocator slack). The rest
holds the same `K` resident experts per layer and the expert ring, two slots of (E - K) experts.
K is the largest count whose lines all fit; with K = E nothing streams and the ring is gone. The
plan never exceeds the budget (a property test checks it); where even K = 0 does not fit,
`plan_memory` raises a one-line `PlanError`.

Shape legend: L = the stage's layers, E = experts a layer, K = resident experts a layer,
A = experts used per token, T = chunk tokens, S = context tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.kernels.decode_ops import ATTN_SPLITS
from strata_mgpu.model.kv_cache import PLAIN_KV, KVFormat, kv_cell_bytes
from strata_mgpu.model.spec import ModelSpec

GiB = 2**30
ALLOCATOR_SLACK = 0.03  # of the budget: the caching allocator rounds blocks and keeps some cached
# cuBLAS's workspace, which torch keeps for every stream a GEMM runs on (32 MiB on Hopper; less on
# older cards): the stage's compute stream, the graphs' capture stream, and the default stream
GEMM_WORKSPACE = 32 * 2**20
GEMM_STREAMS = 3


class PlanError(ValueError):
    """The budget cannot hold what the stage needs; the message says which lines and by how much."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of VRAM per line for one stage. `budget` None: no cap (CPU)."""

    budget: int | None
    dense: int  # attention, norms, router; embedding and head where the stage has them
    workspace: int  # one layer's experts as bf16: [E, 2F, D] + [E, D, F]
    activations: int  # one chunk's temporaries at their peak
    kv: int  # the KV cells the engine may fill, for every sequence together
    kv_tokens: int
    kv_staging: int  # where a sequence may outgrow kv_tokens: the buffer its host prefix is uploaded into
    # decode graphs' shared pool (one step of the largest graph batch) and GEMM workspaces; on a hybrid
    # model also the DeltaNet state pool's scratch slot (a graph's pad rows and warm-up steps write it)
    decode: int
    slack: int  # allocator rounding and cached blocks
    n_layers: int  # L
    n_experts: int  # E
    resident_per_layer: int  # K
    expert_bytes: int  # the largest expert's bytes (a cache slot, a ring position)
    ring_slots: int
    kv_type: str = "bf16"  # how the KV cells are stored (`KVFormat.describe`: bf16, q8_0, 'k q8_0, v bf16')
    linear_state: int = 0  # a hybrid model's DeltaNet state (conv + recurrent) of `sequences` running sequences
    sequences: int = 0

    @property
    def streamed_per_layer(self) -> int:
        return self.n_experts - self.resident_per_layer

    @property
    def ring_slot_bytes(self) -> int:
        return self.streamed_per_layer * self.expert_bytes

    @property
    def ring(self) -> int:
        return self.ring_slots * self.ring_slot_bytes  # 0 where nothing streams (K = E)

    @property
    def resident(self) -> int:
        return self.n_layers * self.resident_per_layer * self.expert_bytes

    @property
    def resident_share(self) -> float:
        return self.resident_per_layer / self.n_experts

    @property
    def fixed(self) -> int:
        return (self.dense + self.workspace + self.activations + self.kv + self.kv_staging + self.linear_state
                + self.decode + self.slack)

    @property
    def total(self) -> int:
        return self.fixed + self.ring + self.resident

    def lines(self) -> list[tuple[str, int]]:
        """(what, bytes) in the order they are placed; the budget and what is left last."""
        out = [("dense weights", self.dense), ("expert workspace (bf16, one layer)", self.workspace),
               ("activations (one chunk)", self.activations),
               (f"KV pool ({self.kv_tokens:,} tokens, {self.kv_type})", self.kv),
               ("KV staging (host prefix uploads)", self.kv_staging),
               *([(f"DeltaNet state ({self.sequences} sequences)", self.linear_state)] if self.linear_state else []),
               ("decode graphs and GEMM workspaces", self.decode), ("allocator slack", self.slack),
               (f"expert ring ({self.ring_slots} x {self.streamed_per_layer} experts)", self.ring),
               (f"resident experts ({self.resident_per_layer}/{self.n_experts} a layer)", self.resident)]
        if self.budget is not None:
            out += [("total", self.total), ("budget", self.budget), ("unplaced", self.budget - self.total)]
        return out

    def describe(self) -> str:
        return "; ".join(f"{what} {n / 1e9:.2f} GB" for what, n in self.lines())


def vram_plan_line(plan: MemoryPlan, pass_bytes: int) -> str:
    """A stage's VRAM plan in one line (`strata info --max-vram` prints it line by line)."""
    budget = f" of {plan.budget / 2**30:.1f}" if plan.budget is not None else ""
    return (f"VRAM plan {plan.total / 2**30:.1f}{budget} GiB: {plan.resident_per_layer}/{plan.n_experts} experts a "
            f"layer resident ({plan.resident / 1e9:.2f} GB), a prompt pass streams {pass_bytes / 1e9:.2f} GB, "
            f"KV {plan.kv_tokens:,} tokens in VRAM")


def workspace_bytes(spec: ModelSpec, elem: int = 2) -> int:
    """One layer's experts dequantized: gate and up [E, 2F, D], down [E, D, F]."""
    return spec.n_experts * 3 * spec.expert_ffn * spec.hidden * elem


def activation_bytes(spec: ModelSpec, tokens: int, context: int, elem: int = 2, kv_dequantized: bool = False) -> int:
    """Peak of one layer's temporaries for `tokens` rows after `context` keys: the residual and block
    inputs plus the larger of the MoE block's and attention's (`kv_dequantized`: a quantized cache
    dequantized to the chunk's end), and a quarter more for what this misses."""
    m = tokens * spec.n_experts_used
    rows = tokens * (spec.hidden * 4 + spec.q_dim * 2 + spec.kv_dim * 2) * elem  # x, h, q, k, v, attn out
    moe = m * (3 * spec.hidden + 4 * spec.expert_ffn) * elem + m * 8 * 4 + tokens * spec.n_experts * 4
    attention = 2 * context * spec.n_heads * spec.head_dim * elem + tokens * spec.q_dim * elem * 2
    attention += 2 * context * spec.kv_dim * elem if kv_dequantized else 0
    return int(1.25 * (rows + max(moe, attention)))


def decode_bytes(spec: ModelSpec, rows: int, *, head: bool, elem: int = 2) -> int:
    """Beyond the KV: cuBLAS's workspaces and the graphs' shared pool (one step's temporaries for the
    largest graph batch of `rows` rows; a hybrid's DeltaNet step holds about four copies of a row's
    recurrent state [Hv, Dk, Dv] fp32 at once: gathered, decayed, updated, and the conv's window).
    A quarter more, as for the activations."""
    d = spec.delta
    per_row = (spec.n_heads * ATTN_SPLITS * (spec.head_dim + 2) * 4
               + (spec.hidden * 8 + spec.q_dim * 3 + spec.kv_dim * 2) * elem
               + spec.n_experts * 4 * 2 + (spec.vocab_size * (elem + 4) if head else 0)
               + (4 * d.n_v_heads * d.k_head_dim * d.v_head_dim * 4 + d.conv_dim * d.conv_kernel * 4
                  if d is not None else 0))
    return GEMM_STREAMS * GEMM_WORKSPACE + int(1.25 * rows * per_row)


def dense_bytes(spec: ModelSpec, n_layers: int, *, embed: bool, head: bool, elem: int = 2, first: int = 0) -> int:
    """The dense weights a stage of layers [first, first + n_layers) keeps in VRAM, as
    `model.weights.load_weights` lays them out."""
    d = spec.hidden
    table = spec.vocab_size * d * elem
    ends = (table if embed or (head and spec.tied_output) else 0) + ((d * elem + (0 if spec.tied_output else table))
                                                                     if head else 0)
    return sum(layer_dense_bytes(spec, i, elem) for i in range(first, first + n_layers)) + ends


def layer_dense_bytes(spec: ModelSpec, layer: int, elem: int = 2) -> int:
    """One layer's dense weights: norms and the fp32 router, its token mixer (attention, or gated
    DeltaNet), and a shared expert where the model has one."""
    d, fs = spec.hidden, spec.shared_expert_ffn
    out = 2 * d * elem + spec.n_experts * d * 4
    if fs:  # gate, up, down and its gate's input
        out += (3 * fs * d + d) * elem
    delta = spec.delta
    if spec.is_linear(layer) and delta is not None:  # qkv, z, beta, alpha, conv, out, dt, a, norm; key heads int64
        c, hv, v = delta.conv_dim, delta.n_v_heads, delta.value_dim
        return out + (c * d + 2 * v * d + 2 * hv * d + c * delta.conv_kernel + 2 * hv + delta.v_head_dim) * elem \
            + hv * 8
    return out + (spec.q_proj_dim * d + spec.q_dim * d + 2 * spec.kv_dim * d + 2 * spec.head_dim) * elem


def kv_layers(spec: ModelSpec, layers: range) -> int:
    """Layers of `layers` whose keys and values a sequence's KV holds: the full-attention ones."""
    return sum(not spec.is_linear(i) for i in layers)


def plan_stage_memory(spec: ModelSpec, *, kv_tokens: int, context: int, chunk_tokens: int,
                      on_halved: Callable[[int, int], None] = lambda had, now: None, **plan_args) -> MemoryPlan:
    """`plan_memory` for sequences of up to `context` tokens: where the budget cannot hold `kv_tokens`
    of KV in VRAM, halve it (down to one chunk, at least 1,024) and let longer sequences keep their
    older KV in host RAM; `on_halved(had, now)` is told each time."""
    context = max(context, kv_tokens)
    floor = min(kv_tokens, max(chunk_tokens, 1024))
    while True:
        try:
            return plan_memory(spec, kv_tokens=kv_tokens, context=context, chunk_tokens=chunk_tokens, **plan_args)
        except PlanError:
            if kv_tokens <= floor:
                raise
            had, kv_tokens = kv_tokens, max(floor, kv_tokens // 2)
            on_halved(had, kv_tokens)


def kv_bytes(spec: ModelSpec, n_layers: int, tokens: int, elem: int = 2,
             kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV) -> int:
    """Keys and values of `tokens` cells in `n_layers` layers, stored as `kv_types`."""
    return n_layers * tokens * kv_cell_bytes(*kv_types, spec.kv_dim, elem)


def plan_memory(spec: ModelSpec, *, n_layers: int, expert_bytes: int, dense: int, budget: int | None,
                chunk_tokens: int, kv_tokens: int, ring_slots: int = 2, elem: int = 2,
                resident_per_layer: int | None = None, where: str = "the stage", context: int | None = None,
                staging_buffers: int = 1, decode_rows: int = 8, head: bool = True,
                expert_workspace: bool = True, kv_layers: int | None = None, linear_state: int = 0,
                sequences: int = 0,
                kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV) -> MemoryPlan:
    """Place the fixed lines, then as many resident experts a layer as the rest holds.

    `kv_tokens` KV cells stay in VRAM; longer sequences (up to `context`) keep their older cells in
    host RAM, assembled in `staging_buffers` buffers of `context` cells. `decode_rows`: the largest
    graph batch; `head`: the stage holds the output head; `expert_workspace`: it dequantizes a
    layer's experts (a CPU stage does not); `kv_types`: how keys and values are stored; `kv_layers`: the
    layers whose KV the cells hold (default all: a hybrid model's DeltaNet layers have none);
    `linear_state`: a sequence's DeltaNet state bytes, held by each of `sequences` running at once (the
    `StatePool`'s slots; its scratch slot, one more, counted with decode's graphs).
    `resident_per_layer` forces K (0: stream everything); it must still fit. Without a budget (CPU)
    K defaults to a quarter of E, so both read paths stay exercised."""
    E = spec.n_experts
    context = max(context or kv_tokens, kv_tokens)
    cell = kv_cell_bytes(*kv_types, spec.kv_dim, elem)  # a position of one layer, keys and values
    staging = staging_buffers * context * cell if context > kv_tokens else 0
    quantized = kv_types != PLAIN_KV
    kv_type = KVFormat(torch.float32 if elem == 4 else torch.bfloat16, *kv_types).describe()
    fixed = dict(dense=dense, workspace=workspace_bytes(spec, elem) if expert_workspace else 0,
                 activations=activation_bytes(spec, min(chunk_tokens, context), context, elem, quantized),
                 kv=kv_bytes(spec, n_layers if kv_layers is None else kv_layers, kv_tokens, elem, kv_types),
                 kv_tokens=kv_tokens, kv_staging=staging, linear_state=linear_state * sequences,
                 sequences=sequences if linear_state else 0,
                 decode=(decode_bytes(spec, decode_rows, head=head, elem=elem) + linear_state
                         if budget is not None else 0),
                 slack=int(ALLOCATOR_SLACK * budget) if budget is not None else 0)

    def plan(k: int) -> MemoryPlan:
        return MemoryPlan(budget=budget, n_layers=n_layers, n_experts=E, resident_per_layer=k, kv_type=kv_type,
                          expert_bytes=expert_bytes, ring_slots=ring_slots, **fixed)

    if budget is None:
        return plan(E // 4 if resident_per_layer is None else resident_per_layer)
    if resident_per_layer is not None:
        if not 0 <= resident_per_layer <= E:
            raise PlanError(f"resident experts {resident_per_layer} a layer: expected 0..{E}")
        forced = plan(resident_per_layer)
        if forced.total > budget:
            raise PlanError(f"{where}: {resident_per_layer} resident experts a layer need "
                            f"{forced.total / GiB:.2f} GiB, over the {budget / GiB:.2f} GiB budget")
        return forced
    # The total is not monotonic in K where the ring vanishes (K = E frees both slots), so try
    # K = E first, then the largest K below it that fits.
    if plan(E).total <= budget:
        return plan(E)
    per_k = n_layers * expert_bytes - ring_slots * expert_bytes  # one more resident: +L experts, -slots
    room = budget - plan(0).total
    if room < 0:
        need = plan(0)
        raise PlanError(f"{where}: a {budget / GiB:.2f} GiB budget cannot hold "
                        + ", ".join(f"{what} {n / GiB:.2f}" for what, n in need.lines()[:7] if n)
                        + f" GiB (needs {need.total / GiB:.2f} GiB; raise --max-vram or lower --ctx-size)")
    k = E - 1 if per_k <= 0 else min(E - 1, room // per_k)
    fits = plan(int(k))
    assert fits.total <= budget  # total(k) = total(0) + k * per_k exactly: the division found the largest k
    return fits
