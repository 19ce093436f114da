"""`DecoderRunner`: the engine's `ModelRunner` over a `Decoder` in host memory (the fp32 reference),
its loader, and what every runner over a `Decoder` shares: the prefill calls, and over a hybrid
decoder its sequences as `HybridSequence`s (KV and DeltaNet state) with the prefix cache's snapshots
(`with_linear_state`, `mark_linear_states`, `taken_linear_states`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.decoder import Decoder, Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_cache import PLAIN_KV, SequenceKV
from strata_mgpu.model.kv_pool import (
    DEFAULT_BLOCK_TOKENS,
    BlockPool,
    BlockTable,
    KVStorage,
    PagedKV,
    PoolStorages,
    StoragePool,
    free_with,
)
from strata_mgpu.model.linear_state import HybridSequence, LinearSnapshot
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.weights import load_weights

# A runner's sequence over a Decoder: its KV, or with a hybrid decoder its KV and DeltaNet state
RunnerSequence = SequenceKV | HybridSequence

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


class DecoderRunner:
    """The engine's `ModelRunner` over a `Decoder` in host memory: no VRAM limit, nothing replayed. Its
    KV pool holds twice the cells asked for (the running sequences' and as many of cached prefixes,
    there being no host tier beside it)."""

    kv_token_budget: int | None = None  # KV cells of all sequences together: no limit

    def __init__(self, model: Decoder):
        self.model = model
        self.spec = model.spec
        self._pool: StoragePool | None = None  # the latest: where a sequence without a table takes its blocks
        self._storages = PoolStorages()

    @property
    def max_context(self) -> int:
        return self.spec.context_length

    def kv_pool(self, block_tokens: int, cells: int) -> StoragePool:
        """A fresh pool: blocks for twice `cells`."""
        s = self.spec
        n_blocks = max(1, -(-2 * cells // block_tokens))
        blocks = BlockPool(n_blocks, block_tokens)
        storage = self._storages.add(
            blocks, lambda: KVStorage(self.model.n_kv_layers, s.n_kv_heads, s.head_dim, n_blocks=n_blocks,
                                      block_tokens=block_tokens, device=self.model.device,
                                      format=self.model.kv_format),
            lambda st: (st.n_blocks, st.block_tokens) == (n_blocks, block_tokens))
        self._pool = StoragePool(blocks, storage)
        return self._pool

    def warm_decode_graphs(self, context: int) -> list[int]:
        return []

    def silent_faults(self) -> int:
        return 0  # every op runs in order on the host and raises where it fails

    def describe(self) -> str:
        return (f"{self.model.device} in {dtype_name(self.model.w.dtype)}: the torch reference forward (plain "
                f"torch ops, every expert in host RAM)")

    def new_sequence(self, max_length: int, table: BlockTable | None = None, length: int = 0,
                     state: LinearSnapshot | None = None) -> RunnerSequence:
        """A `PagedKV` of the attention layers; on a hybrid model with the linear layers' state beside it
        (`state`: its snapshot at `length`, a cached prefix)."""
        pool = self._pool or self.kv_pool(DEFAULT_BLOCK_TOKENS, self.spec.context_length)
        own = table is None
        table = BlockTable(pool.blocks, max_length) if table is None else table
        kv = PagedKV(self._storages.of(table.pool), table, length=length, max_length=max_length)
        if own:
            free_with(kv, table)
        return with_linear_state(self.model, kv, length, state)

    def mark_states(self, kv: RunnerSequence, boundaries: Sequence[int]) -> None:
        mark_linear_states(kv, boundaries)

    def taken_states(self, kv: RunnerSequence) -> dict[int, LinearSnapshot]:
        return taken_linear_states(kv)

    @torch.inference_mode()
    def prefill(self, kv: RunnerSequence, tokens: torch.Tensor, whole_prompt: bool = False,
                want_logits: bool = True) -> torch.Tensor:
        return prefill_last_logits(self.model, kv, tokens)

    @torch.inference_mode()
    def prefill_many(self, kvs: Sequence[RunnerSequence], chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        return prefill_pack_logits(self.model, kvs, chunks)

    @torch.inference_mode()
    def decode(self, kvs: Sequence[RunnerSequence], tokens: torch.Tensor) -> torch.Tensor:
        segments = [segment(i, i + 1, kv) for i, kv in enumerate(kvs)]
        return self.model.logits(self.model.forward(tokens.to(self.model.device), segments))


def with_linear_state(model: Decoder, kv: SequenceKV, length: int, state: LinearSnapshot | None,
                      snapshots_on: torch.device | None = None) -> RunnerSequence:
    """A new sequence's KV as itself, or on a hybrid decoder with a fresh DeltaNet state beside it
    (`state`: its snapshot at `length`, a cached prefix, restored; `snapshots_on`: `LinearState`'s)."""
    linear = model.new_linear_state(snapshots_on)
    if linear is None:
        assert state is None, "a snapshot for a decoder without linear layers"
        return kv
    if length:
        assert state is not None and state.length == length, "a hybrid prefix comes with its state's snapshot"
        linear.restore(state)
    return HybridSequence(kv, linear)


def mark_linear_states(seq: RunnerSequence, boundaries: Sequence[int]) -> None:
    """`ModelRunner.mark_states` over a runner's sequence (no-op without a DeltaNet state)."""
    if isinstance(seq, HybridSequence):
        seq.linear.mark(*boundaries)


def taken_linear_states(seq: RunnerSequence) -> dict[int, LinearSnapshot]:
    """`ModelRunner.taken_states`: the marked snapshots every linear layer has recorded, by token count."""
    if not isinstance(seq, HybridSequence):
        return {}
    out = {}
    for b in seq.linear.pending_marks():
        snap = seq.linear.taken(b)
        if snap is not None:
            out[b] = snap
    return out


def segment(start: int, end: int, seq: RunnerSequence) -> Segment:
    """Rows [start, end) of a forward as `seq`'s segment: its KV, and its DeltaNet state where it has one."""
    if isinstance(seq, HybridSequence):
        return Segment(start, end, seq.kv, seq.linear)
    return Segment(start, end, seq)


def prefill_last_logits(model: Decoder, kv: RunnerSequence, tokens: torch.Tensor) -> torch.Tensor:
    hidden = model.forward(tokens.to(model.device), [segment(0, tokens.shape[0], kv)])
    return model.logits(hidden[-1:])[0]


def prefill_pack_logits(model: Decoder, kvs: Sequence[RunnerSequence], chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    """One forward packed as segments; logits [N, V] of each chunk's last token."""
    assert len(kvs) == len(chunks) > 0 and len({id(kv) for kv in kvs}) == len(kvs)
    ends = list(itertools.accumulate(c.shape[0] for c in chunks))
    segments = [segment(end - c.shape[0], end, kv) for kv, c, end in zip(kvs, chunks, ends, strict=True)]
    hidden = model.forward(torch.cat(list(chunks)).to(model.device), segments)  # [sum T_i, D]
    return model.logits(torch.cat([hidden[end - 1:end] for end in ends]))  # slices: no index upload


def load_reference_runner(f: GGUFFile, spec: ModelSpec, on_progress: Callable[[int, int], None] | None = None,
                          kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV) -> DecoderRunner:
    """Dequantize a validated GGUF's weights to fp32; `on_progress(done, total)` counts layers."""
    weights = load_weights(f, spec, on_layer=(lambda i: on_progress(i + 1, spec.n_layers)) if on_progress else None)
    return DecoderRunner(ReferenceModel(spec, weights, kv_types=kv_types))
