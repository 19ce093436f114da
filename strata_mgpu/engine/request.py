"""A request as the engine holds it, and what its client is told.

A request's phase goes waiting -> prefill -> decode -> done (any phase may end in done). Only the
engine's thread changes a request once it is queued. `ContextOverflow` and `Failure` are the two
ways a request ends in an error: too long for the context or the KV budget, or a model call failed.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from strata_mgpu.engine.device_sampler import DrawState, TokenLogprobs
from strata_mgpu.engine.runner import SequenceState
from strata_mgpu.engine.sampler import SamplingParams, StopMatcher
from strata_mgpu.model.kv_pool import BlockTable
from strata_mgpu.model.tokenizer import IncrementalDetokenizer

log = logging.getLogger("strata.engine")


class ContextOverflow(ValueError):
    """The prompt plus the tokens asked for do not fit the context."""

    def __init__(self, n_prompt_tokens: int, max_tokens: int, n_ctx: int):
        self.n_prompt_tokens, self.max_tokens, self.n_ctx = n_prompt_tokens, max_tokens, n_ctx
        super().__init__(f"the request needs {n_prompt_tokens} prompt tokens + {max_tokens} to generate, "
                         f"more than the context of {n_ctx} tokens")


@dataclass
class Timings:
    """llama.cpp's `timings` fields, and `queue_ms`: from submission to the first prompt chunk's launch,
    which prompt_ms does not count. As llama-server counts them, `prompt_n` is the prompt tokens
    computed and `cache_n` those taken from the prefix cache."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    queue_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "queue_ms": self.queue_ms, "cache_n": self.cache_n, "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms else 0.0,
            "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.predicted_n if self.predicted_n else 0.0,
            "predicted_per_second": 1e3 * self.predicted_n / self.predicted_ms if self.predicted_ms else 0.0,
        }


@dataclass
class RequestOutput:
    """New text of one request since its last output; the last one has `finished` set."""

    request_id: str
    text: str
    token_ids: list[int]
    n_prompt_tokens: int
    n_generated: int
    finished: bool = False
    finish_reason: str | None = None  # 'stop', 'length', 'abort' or 'error'
    error: str | None = None
    error_status: int = 500  # the HTTP status an error maps to: 503 where the device ran out of memory
    timings: Timings | None = None
    logprobs: list[TokenLogprobs] | None = None  # one a token of token_ids, where the request asked for them


@dataclass(frozen=True)
class Failure:
    """Why a model call failed, as the requests in it are told."""

    message: str
    status: int  # HTTP: 503 when the device ran out of memory (try again later), else 500

    @classmethod
    def of(cls, e: Exception) -> Failure:
        """Logged once: one line for an out-of-memory error (its requests' memory is freed as they end, and
        the other requests go on), the traceback for anything else."""
        if isinstance(e, torch.OutOfMemoryError):
            log.error("the device ran out of memory in a model call; its requests end with 503, the rest go on")
            torch.cuda.empty_cache()  # hand what the failed call held back to the allocator's pool
            return cls("the device ran out of memory while running this request; it was dropped and its memory "
                       "freed: retry it, or send a shorter one", 503)
        log.exception("model call failed")
        return cls(f"{type(e).__name__}: {e}", 500)


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], object]  # what it returns is not read
    detok: IncrementalDetokenizer
    stops: StopMatcher
    phase: Phase = Phase.WAITING
    draw: DrawState | None = None  # the sampler's state of the request, from admission on
    kv: SequenceState | None = None  # the runner's state of the sequence, from admission to its end
    table: BlockTable | None = None  # its KV's blocks in the runner's pool, as long as `kv`
    n_prefilled: int = 0  # tokens of `prefill_tokens` in the KV cache
    n_cached: int = 0  # prompt tokens taken from the prefix cache (not computed)
    resumed: list[int] = field(default_factory=list)  # tokens it had drawn when it was preempted: prefilled again
    states: dict[int, Any] = field(default_factory=dict)  # a hybrid model's state snapshots, by token count
    n_preempted: int = 0
    last_token: torch.Tensor | None = None  # [1] on the device: the newest drawn token, the next decode input
    generated: list[int] = field(default_factory=list)  # tokens landed on the host and accepted
    timings: Timings = field(default_factory=Timings)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_chunk: float = 0.0
    # the runner's `silent_faults` before the prompt's first chunk was launched: a fault while any
    # chunk of it ran fails the request when its first token lands
    faults_at_first_chunk: int = 0
    t_prompt_done: float = 0.0

    @property
    def prefill_tokens(self) -> list[int]:
        """What its prefill computes: the prompt, and after a preemption the tokens drawn before it."""
        return [*self.prompt, *self.resumed] if self.resumed else self.prompt

    @property
    def kv_tokens(self) -> int:
        """The KV cells the request may come to hold (the one-step-late stop stays within it)."""
        return len(self.prompt) + self.params.max_tokens

    @property
    def cacheable_table(self) -> BlockTable | None:
        """Its table where the prefix cache may index it (its KV in the blocks by position); None without
        one, or for a request longer than the pool, whose table's blocks are the VRAM ring of a two-tier
        cache (a block there holds whatever positions last passed through it)."""
        t = self.table
        return t if t is not None and t.max_blocks * t.pool.block_tokens >= self.kv_tokens else None

    @property
    def draw_state(self) -> DrawState:
        assert self.draw is not None, f"{self.id} draws before its admission or after its end"
        return self.draw

    @property
    def kv_state(self) -> SequenceState:
        assert self.kv is not None, f"{self.id} runs before its first chunk or after its end"
        return self.kv

    @property
    def decode_input(self) -> torch.Tensor:
        """[1] on the device: the token its next decode step is fed (the last one drawn)."""
        assert self.last_token is not None, f"{self.id} decodes before its prompt's first token"
        return self.last_token
