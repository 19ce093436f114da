"""Token sampling: penalties, temperature, top-k, top-p, min-p, seeded draws; and stop strings."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch


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


@dataclass
class Sampler:
    """Draws one request's tokens. Seeded: the same seed gives the same draws."""

    params: SamplingParams
    generator: torch.Generator = field(init=False)
    counts: Counter[int] = field(default_factory=Counter)  # generated token id -> times

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        seed = self.params.seed
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] (any device) -> the next token id."""
        logits = self.penalized(logits)
        if self.params.temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(self.filtered(logits / self.params.temperature), 1,
                                          generator=self.generator))
        self.counts[token] += 1
        return token

    def penalized(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> fp32 on the host, less the presence and frequency penalties of the tokens
        generated so far."""
        p = self.params
        logits = logits.float().cpu()
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self.counts.keys()))
            n = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits = logits.clone()
            logits[ids] -= p.presence_penalty + p.frequency_penalty * n
        return logits

    def filtered(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled logits [V] -> the probabilities [V] a draw is made from (top-k,
        top-p and min-p applied, normalized)."""
        p = self.params
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
            probs = probs.clone()
            probs[order[drop]] = 0.0
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum()


class StopMatcher:
    """Finds stop strings in streamed text, also when split across tokens.

    `feed(delta)` returns (text safe to emit, stopped). Text that could still be the start of a
    stop string is held back until it cannot; at a stop, the text from the stop string on is dropped.
    """

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
