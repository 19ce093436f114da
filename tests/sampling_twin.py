"""The batch sampler's plain twin: one request's draws on the host, the filters and penalties
written out as the OpenAI and llama.cpp parameters define them. `strata_mgpu.engine.device_sampler.
BatchSampler` is checked against it (tests/test_device_sampler.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from strata_mgpu.engine.sampler import SamplingParams


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
