"""What the engine needs of a model: `ModelRunner`, all of it declared.

`model.runner.DecoderRunner` implements it over a `Decoder` (the CPU reference), `stage.Stage`
over one device, `split.runner.SplitRunner` over chained stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch

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
S_contra = TypeVar("S_contra", bound=SequenceState, contravariant=True)


class KVBlocks(Protocol[S_contra]):
    """Fixed-size blocks of a runner's sequences' KV, for the prefix cache: copies out of a sequence,
    to host RAM, and back into a fresh sequence. Every copy is queued in order behind the runner's
    forwards (no host wait)."""

    @property
    def block_tokens(self) -> int: ...

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes (on the device, or in host RAM once offloaded)."""
        ...

    @property
    def host_tier(self) -> bool:
        """Blocks can move to pinned host RAM (False where the runner's device is the host)."""
        ...

    def cacheable(self, kv: S_contra) -> bool:
        """False for a sequence whose KV spills."""
        ...

    def save(self, kv: S_contra, index: int) -> Any:
        """Positions [index B, (index + 1) B) of the sequence, every layer, as a new device block."""
        ...

    def offload(self, block: Any) -> Any:
        ...

    def load(self, kv: S_contra, blocks: Sequence[Any], n_tokens: int) -> None:
        """Blocks copied into a fresh sequence at positions 0.., which then holds `n_tokens`."""
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
        """The longest sequence the runner can hold (in VRAM, or partly in host RAM)."""
        ...

    def kv_cells(self, tokens: int) -> int:
        """Cells of `kv_token_budget` a sequence of `tokens` takes (fewer where older cells live in host RAM)."""
        ...

    def new_sequence(self, max_length: int) -> S:
        """State of one sequence (its KV cache), able to hold max_length tokens."""
        ...

    def kv_blocks(self, block_tokens: int) -> KVBlocks[S]:
        """Blocks of `block_tokens` positions of its sequences' KV (the prefix cache's store)."""
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
