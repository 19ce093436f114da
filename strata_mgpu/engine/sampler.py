"""What a request asks of generation (`SamplingParams`) and its stop strings (`StopMatcher`). The
draws themselves are the device's (`device_sampler.BatchSampler`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata_mgpu.engine.grammar import Grammar

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of generation. temperature 0 means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -inf bans it
    grammar: Grammar | None = None  # the tokens drawn must follow it; its end ends the request
    logprobs: int | None = None  # report each drawn token's logprob and this many alternatives (0..20); None: off

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        if any(math.isnan(b) or b == math.inf for _, b in self.logit_bias):
            raise ValueError("a logit bias must be a number or -inf")


class StopMatcher:
    """Finds stop strings in streamed text, also when split across tokens. `feed(delta)` returns (text
    safe to emit, stopped): text that could still start a stop string is held back until it cannot;
    at a stop, the text from the stop string on is dropped."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._pending = ""
        self._hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return text[:min(hits)], True
        keep = 0  # longest tail of text that is a proper prefix of some stop string
        for n in range(min(self._hold, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                keep = n
                break
        self._pending = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
