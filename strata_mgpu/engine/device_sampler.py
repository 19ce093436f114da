"""The engine's sampler: every row of a batch drawn on the logits' device in one pass.

Shape legend: B = rows, V = vocab, P = rows with penalties, M = rows under a grammar, W = mask
words (ceil(V / 32)), L = rows that report logprobs, K = the most alternatives one of them asks.

`tests/sampling_twin.Sampler` is the plain twin; this draws from the same distribution per row.
Only the chosen ids [B] leave the device, and nothing here waits. Randomness is counter-based:
the uniform of (request seed, draw index, vocab id) is a hash of the three, so a request's draws
depend on nothing but itself. A row's token wins an exponential race, argmax_i(log p_i - log E_i),
E_i = -log u_i ~ Exp(1), which picks i with probability p_i (Gumbel-max).

Before the draw: penalties, logit biases, then the grammar's mask (-inf where disallowed).
Logprobs are the log-softmax of the model's logits before any of those, as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from strata_mgpu.engine.grammar import GrammarMatcher, allowed_tokens, fill_bitmasks, mask_words
from strata_mgpu.engine.sampler import SamplingParams

MASK32 = 0xFFFFFFFF
# lowbias32's constants from the hash prospector (shifts 16, 15, 15). Both are below 2**31: a
# 32-bit value times either fits an int64, so the tensor hash never overflows and the CPU and
# CUDA give the same bits.
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97


def mix32(x):
    """A 32-bit hash of x in [0, 2**32): a Python int, or an int64 tensor elementwise."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 15)


def draw_keys(seed: int, index: int) -> tuple[int, int]:
    """The two 32-bit keys of a request's draw number `index` (0 for its first token)."""
    s = seed & (2**64 - 1)
    a = mix32(mix32((s & MASK32) ^ 0x9E3779B9) ^ (s >> 32))
    k1 = mix32(a ^ mix32((index & MASK32) ^ 0x85EBCA6B))
    return k1, mix32(k1 ^ 0xC2B2AE35)


def uniforms(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """keys [B, 2] int64, vocab_hash [V] (mix32 of the vocab ids) -> u [B, V] fp64 in (0, 1)."""
    h = mix32(mix32(vocab_hash[None, :] ^ keys[:, :1]) ^ keys[:, 1:])  # [B, V] in [0, 2**32)
    return (h.double() + 0.5) * 2.0**-32


def race_noise(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """-log E with E = -log u ~ Exp(1): Gumbel noise [B, V] fp32. fp64 for the logs: in fp32, u within
    2**-25 of 1 rounds to 1 and its E to 0, a sure winner about once in 100 draws at V = 152K."""
    return (-torch.log(-torch.log1p(-uniforms(keys, vocab_hash)))).float()


@dataclass
class DrawState:
    """One request's place in the sampler: its parameters, its seed, the draws made so far."""

    params: SamplingParams
    seed: int
    n_drawn: int = 0  # the index of the next draw (counts drawn tokens, discarded ones too)
    slot: int | None = None  # the request's row of the token-count table (penalized requests only)
    grammar: GrammarMatcher | None = None  # where the request stands in its grammar (advanced as tokens land)
    landed_logprobs: list[TokenLogprobs] = field(default_factory=list)  # landed, not yet in an output

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.params.presence_penalty or self.params.frequency_penalty)

    @property
    def needs_sort(self) -> bool:
        return not self.greedy and (self.params.top_k > 0 or self.params.top_p < 1.0)


@dataclass(frozen=True)
class TokenLogprobs:
    """A drawn token's logprob and the most likely alternatives', under the model's distribution."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass
class Draw:
    """One `BatchSampler.draw`: a token per row, and the logprobs of the rows that ask for them."""

    tokens: torch.Tensor  # [B] int64 on the logits' device
    logprob_rows: list[int] = field(default_factory=list)  # the rows of `logprobs`, in order
    top_counts: list[int] = field(default_factory=list)  # alternatives each of those rows asked for
    logprobs: torch.Tensor | None = None  # [L, 1 + 2K] fp64 on the device: drawn token's, top K ids, top K's


class BatchSampler:
    """Draws the next token of every row of a batch on the logits' device: `open(params)` gives a
    request its state, `draw(logits, states)` a token per row, `close(state)` frees what it held.
    Calls come from one thread (the engine's)."""

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None  # [slots, V] int32: tokens drawn, per penalized request
        self._free_slots: list[int] = []
        self._n_slots = 0
        self._vocab_hash: torch.Tensor | None = None  # [V] int64: mix32 of each vocab id

    def open(self, params: SamplingParams) -> DrawState:
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        state = DrawState(params=params, seed=seed,
                          grammar=params.grammar.matcher() if params.grammar is not None else None)
        if state.penalized:
            if self._free_slots:
                state.slot = self._free_slots.pop()
            else:
                state.slot, self._n_slots = self._n_slots, self._n_slots + 1
        return state

    def close(self, state: DrawState) -> None:
        """The request is done: its count row is zeroed (queued behind the draws that wrote it) and given back."""
        state.grammar = None
        if state.slot is None:
            return
        if self._counts is not None and state.slot < self._counts.shape[0]:
            self._counts[state.slot].zero_()
        self._free_slots.append(state.slot)
        state.slot = None

    def sample(self, logits: torch.Tensor, states: Sequence[DrawState]) -> torch.Tensor:
        """logits [B, V] (row i belongs to states[i]) -> token ids [B] int64 on the same device."""
        return self.draw(logits, states).tokens

    def draw(self, logits: torch.Tensor, states: Sequence[DrawState]) -> Draw:
        """logits [B, V] (row i belongs to states[i]) -> a token per row, and the logprobs asked for."""
        n_rows, vocab = logits.shape
        assert n_rows == len(states) > 0
        device = logits.device
        model_logits = logits = logits.float()  # never written in place: the caller's, and the logprobs'
        table = self._params_table(states, device)  # [B, 8] fp64
        pen_rows = [i for i, s in enumerate(states) if s.penalized]
        pen_index = None
        if pen_rows:
            pen_index = _upload([[i, _slot(states[i])] for i in pen_rows], torch.long, device)  # [P, 2]: row, slot
            counts = self._count_table(device, vocab)[pen_index[:, 1]].float()  # [P, V]
            rows = table[pen_index[:, 0]].float()
            penalty = rows[:, 4:5] * (counts > 0) + rows[:, 5:6] * counts
            logits = logits.index_add(0, pen_index[:, 0], penalty, alpha=-1.0)
        logits = _biased(logits, states)
        logits = _masked(logits, states)
        if all(s.greedy for s in states):
            tokens = logits.argmax(-1)
        else:
            drawn = self._draw(logits, table, any(s.needs_sort for s in states))
            greedy = table[:, 0] == 0
            tokens = torch.where(greedy, logits.argmax(-1), drawn) if any(s.greedy for s in states) else drawn
        if pen_index is not None:  # one (slot, token) per row: no duplicates, no accumulating scatter
            assert self._counts is not None
            cells = (pen_index[:, 1], tokens[pen_index[:, 0]])
            self._counts.index_put_(cells, self._counts[cells] + 1)
        for s in states:
            s.n_drawn += 1
        return _with_logprobs(Draw(tokens), model_logits, states)

    def _draw(self, logits: torch.Tensor, table: torch.Tensor, sort: bool) -> torch.Tensor:
        """Penalized logits [B, V], parameters [B, 8] -> a drawn token per row [B]."""
        temperature, top_k, top_p, min_p = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
        keys = table[:, 6:8].long()  # [B, 2]
        scaled = logits / torch.where(temperature > 0, temperature, 1.0).float()[:, None]  # [B, V]
        noise = race_noise(keys, self._hash_of_vocab(logits.shape[1], logits.device))  # [B, V]
        log_min_p = torch.log(min_p).float()[:, None]  # -inf where min-p is off
        if not sort:
            keep = scaled >= scaled.amax(-1, keepdim=True) + log_min_p
            return torch.where(keep, scaled + noise, float("-inf")).argmax(-1)
        vocab = logits.shape[1]
        ranked, order = scaled.sort(dim=-1, descending=True)  # [B, V] each
        k = top_k.long()
        kth = ranked.gather(1, (k - 1).clamp(0, vocab - 1)[:, None])  # [B, 1]
        kth = torch.where(((k > 0) & (k < vocab))[:, None], kth, float("-inf"))
        keep = ranked >= kth  # ties with the k-th value stay, as in the twin
        probs = torch.softmax(ranked.masked_fill(~keep, float("-inf")), dim=-1)
        # the smallest prefix whose mass reaches top_p (the first token always)
        keep &= ((probs.cumsum(-1) - probs) < top_p.float()[:, None]) | (top_p >= 1.0)[:, None]
        keep &= ranked >= ranked[:, :1] + log_min_p
        winner = torch.where(keep, ranked + noise.gather(1, order), float("-inf")).argmax(-1, keepdim=True)
        return order.gather(1, winner)[:, 0]

    def _params_table(self, states: Sequence[DrawState], device: torch.device) -> torch.Tensor:
        """[B, 8] fp64: temperature, top_k, top_p, min_p, presence, frequency and the two draw keys
        (32-bit integers, exact in fp64)."""
        rows = []
        for s in states:
            p = s.params
            rows.append([p.temperature, p.top_k, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                         *draw_keys(s.seed, s.n_drawn)])
        return _upload(rows, torch.float64, device)

    def _count_table(self, device: torch.device, vocab: int) -> torch.Tensor:
        t = self._counts
        if t is None or t.shape[0] < self._n_slots:
            grown = torch.zeros(max(self._n_slots, 2 * (t.shape[0] if t is not None else 0), 4), vocab,
                                dtype=torch.int32, device=device)
            if t is not None:
                grown[:t.shape[0]] = t
            self._counts = t = grown
        assert t.shape[1] == vocab and t.device == device, "one sampler serves one vocab on one device"
        return t

    def _hash_of_vocab(self, vocab: int, device: torch.device) -> torch.Tensor:
        h = self._vocab_hash
        if h is None or h.shape[0] != vocab or h.device != device:
            h = self._vocab_hash = mix32(torch.arange(vocab, dtype=torch.long, device=device))
        return h


def _biased(logits: torch.Tensor, states: Sequence[DrawState]) -> torch.Tensor:
    cells = [(i, token, bias) for i, s in enumerate(states) for token, bias in s.params.logit_bias]
    if not cells:
        return logits
    table = _upload([list(c) for c in cells], torch.float64, logits.device)  # [N, 3]: row, token, bias
    index = (table[:, 0].long(), table[:, 1].long())
    return logits.index_put(index, table[:, 2].float(), accumulate=True)


def _masked(logits: torch.Tensor, states: Sequence[DrawState]) -> torch.Tensor:
    """Rows under a grammar keep only the tokens it allows next. A grammar that is done masks nothing:
    that row's token is dropped anyway."""
    rows = [i for i, s in enumerate(states) if s.grammar is not None and not s.grammar.done]
    if not rows:
        return logits
    vocab = logits.shape[1]
    bits = torch.empty((len(rows), mask_words(vocab)), dtype=torch.int32,
                       pin_memory=logits.device.type == "cuda")  # [M, W]
    fill_bitmasks([_matcher(states[i]) for i in rows], bits)
    index = _upload([rows], torch.long, logits.device)[0]  # [M]
    allowed = allowed_tokens(bits.to(logits.device, non_blocking=True), vocab)  # [M, V]
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))


def _with_logprobs(drawn: Draw, model_logits: torch.Tensor, states: Sequence[DrawState]) -> Draw:
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return drawn
    counts = [_top_count(states[i]) for i in rows]
    k = max(counts)
    index = _upload([rows], torch.long, model_logits.device)[0]  # [L]
    logprobs = torch.log_softmax(model_logits.index_select(0, index), dim=-1)  # [L, V]
    chosen = logprobs.gather(1, drawn.tokens.index_select(0, index)[:, None])  # [L, 1]
    top = logprobs.topk(k, dim=-1)  # sorted, most likely first: [L, K] each
    drawn.logprob_rows, drawn.top_counts = rows, counts
    drawn.logprobs = torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1)
    return drawn


def _top_count(state: DrawState) -> int:
    assert state.params.logprobs is not None
    return state.params.logprobs


def _matcher(state: DrawState) -> GrammarMatcher:
    assert state.grammar is not None
    return state.grammar


def _slot(state: DrawState) -> int:
    assert state.slot is not None, "a penalized request has its count table row from `open`"
    return state.slot


def _upload(rows: list[list[float]] | list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host table to the device without a host wait (pinned, asynchronous on a GPU)."""
    host = torch.tensor(rows, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
