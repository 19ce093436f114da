"""What the engine needs of a model: `ModelRunner`, all of it declared.

`model.runner.DecoderRunner` implements it over a `Decoder` (the CPU reference), `stage.Stage`
over one device, `split.runner.SplitRunner` over chained stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch

from strata_mgpu.model.kv_pool import BlockPool, BlockTable
from strata_mgpu.model.spec import ModelSpec


class SequenceState(Protocol):
    """One sequence's state inside a runner (its KV), opaque to the engine but for its size."""

    @property
    def nbytes(self) -> int:
        """Device bytes its KV holds now."""
        ...

    @property
    def length(self) -> int:
        """Positions its KV holds (written by the forwards launched so far)."""
        ...


S = TypeVar("S", bound=SequenceState)


class KVPool(Protocol):
    """A runner's paged KV (model/kv_pool.py): the blocks' bookkeeping, which the engine drives (its
    sequences' tables, the prefix cache's references), and the copies of whole blocks on every stage the
    runner has, each queued in order behind its forwards (no host wait)."""

    @property
    def blocks(self) -> BlockPool: ...

    @property
    def block_bytes(self) -> int:
        """Device bytes one block takes on all the runner's stages together."""
        ...

    @property
    def host_tier(self) -> bool:
        """Blocks can be kept in pinned host RAM (False where the runner's device is the host)."""
        ...

    def copy_block(self, src: int, dst: int) -> None:
        """Block src's cells into block dst (a shared partial block copied before a sequence writes it)."""
        ...

    def offload(self, block: int) -> Any:
        """The block's cells copied to host RAM (queued): what `load` takes back."""
        ...

    def load(self, data: Any, block: int) -> None:
        """Cells `offload` returned copied into `block` (queued)."""
        ...


class ModelRunner(Protocol[S]):
    """A model the engine drives; S is the runner's own sequence state."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def kv_token_budget(self) -> int | None:
        """KV cells the runner holds in VRAM for all its sequences together; None: no limit."""
        ...

    @property
    def max_context(self) -> int:
        """The longest sequence the runner can hold (in its pool, or partly in host RAM)."""
        ...

    def kv_pool(self, block_tokens: int, cells: int) -> KVPool:
        """A fresh KV pool of blocks of `block_tokens` positions, what every later sequence's blocks come from
        (one engine drives a runner: an earlier pool's blocks are forgotten). `cells`: the positions asked
        for where the runner has no plan of its own (the CPU reference); a stage's pool holds what its VRAM
        plan keeps."""
        ...

    def new_sequence(self, max_length: int, table: BlockTable | None = None, length: int = 0,
                     state: Any = None) -> S:
        """State of one sequence able to hold max_length tokens, its KV in `table`'s blocks of the runner's
        pool (the first `length` positions already written: a cached prefix; on a hybrid model `state` is
        its linear layers' snapshot at `length`, from `taken_states`). Without a table (tools, tests) the
        sequence takes a table of its own, freed with it. A sequence longer than the pool holds takes a
        table of every block: its older cells live in host RAM."""
        ...

    def mark_states(self, kv: S, boundaries: Sequence[int]) -> None:
        """A hybrid model: snapshot the sequence's linear layers' state as its next forwards pass each of
        these token counts (no-op elsewhere)."""
        ...

    def taken_states(self, kv: S) -> dict[int, Any]:
        """The snapshots `mark_states` asked for that the forwards have completed, by token count; each
        handed over once (always empty for a model without linear layers)."""
        ...

    def prefill(self, kv: S, tokens: torch.Tensor, whole_prompt: bool = False,
                want_logits: bool = True) -> torch.Tensor | None:
        """Append tokens [T] to the sequence; logits [V] of the last one. `whole_prompt`: the whole prompt
        in one chunk, or all of it past a cached prefix. `want_logits=False`: the runner may return None
        without waiting for the chunk; the last chunk's call waits for the earlier ones and raises their errors."""
        ...

    def prefill_many(self, kvs: Sequence[S], chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """Append chunks[i] [T_i] to distinct sequences kvs[i] in one forward; logits [N, V] of each
        chunk's last token."""
        ...

    def decode(self, kvs: Sequence[S], tokens: torch.Tensor) -> torch.Tensor:
        """One new token per sequence, tokens [B]; logits [B, V]."""
        ...

    def warm_decode_graphs(self, context: int) -> list[int]:
        """Prepare decode's CUDA graphs for sequences of up to `context` tokens; the batch sizes made ready."""
        ...

    def describe(self) -> str:
        """Where it runs, in one line for the log."""
        ...

    def silent_faults(self) -> int:
        """Failures the runner's queued work met without raising, counted since it was built. Where it rose
        between a step's launch and its results reaching the host, the step's results may be wrong."""
        ...
