"""What the engine needs of a model: `ModelRunner`.

The engine sees only this: sequences with their own state, a prefill call per chunk and one
batched decode call per step. `model.runner.DecoderRunner` implements it over a `Decoder` (the
CPU reference, and every GPU stage); `split.runner.SplitRunner` over chained stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from strata_mgpu.model.kv_cache import KVCache
from strata_mgpu.model.spec import ModelSpec


class ModelRunner(Protocol):
    spec: ModelSpec

    def new_sequence(self, max_length: int) -> KVCache:
        """State of one sequence (its KV cache), able to hold max_length tokens."""
        ...

    def prefill(self, kv: KVCache, tokens: torch.Tensor, whole_prompt: bool = False,
                want_logits: bool = True) -> torch.Tensor | None:
        """Append tokens [T] to the sequence; logits [V] of the last one. `whole_prompt`: these
        tokens are the entire prompt, in one chunk (the split runner's helper may then engage).
        `want_logits=False` (a prompt's chunk before its last): the runner may return None without
        waiting for the chunk (the split runner's stages then pipeline); the last chunk's call
        waits for the earlier ones and raises their errors."""
        ...

    def decode(self, kvs: Sequence[KVCache], tokens: torch.Tensor) -> torch.Tensor:
        """One new token per sequence, tokens [B]; logits [B, V]."""
        ...
