"""The engine's sampler: every row of a batch drawn on the logits' device in one pass.

Shape legend: B = rows, V = vocab, P = rows with penalties.

`tests/sampling_twin.Sampler` is the plain twin (one request, on the host); this draws from the same
distribution per row: penalties, temperature, top-k, top-p, min-p; greedy rows (temperature 0)
take the argmax. Only the chosen ids [B] leave the device, and nothing here waits for it: the
per-row parameters go up in one small copy (pinned, asynchronous on a GPU).

Randomness is counter-based, so a request's draws depend on nothing but itself: the uniform of
(request seed, draw index, vocab id) is a hash of the three, computed with int64 ops. Not the row
a request sits in, not its neighbours, not whether the batch needed a sort change a token. A
row's token wins an exponential race, argmax_i(log p_i - log E_i) with E_i = -log u_i i.i.d.
Exp(1), which picks i with probability p_i (the Gumbel-max trick); filtered tokens sit out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    """-log E with E = -log u ~ Exp(1): Gumbel noise [B, V] fp32. fp64 for the logs: in fp32, u
    within 2**-25 of 1 rounds to 1 and its E to 0, a sure winner about once in 100 draws at V = 152K;
    here the noise is exact to the hash's 32 bits (it reaches 22.9, so tokens less likely than about
    e**-26 never win)."""
    return (-torch.log(-torch.log1p(-uniforms(keys, vocab_hash)))).float()


@dataclass
class DrawState:
    """One request's place in the sampler: its parameters, its seed, the draws made so far."""

    params: SamplingParams
    seed: int
    n_drawn: int = 0  # the index of the next draw (counts drawn tokens, discarded ones too)
    slot: int | None = None  # the request's row of the token-count table (penalized requests only)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.params.presence_penalty or self.params.frequency_penalty)

    @property
    def needs_sort(self) -> bool:
        """top-k and top-p cut by rank; min-p needs only the row's maximum."""
        return not self.greedy and (self.params.top_k > 0 or self.params.top_p < 1.0)


class BatchSampler:
    """Draws the next token of every row of a batch on the logits' device.

    `open(params)` gives a request its state, `sample(logits, states)` draws one token per row,
    `close(state)` frees what the request held. Token counts for the penalties live on the device,
    one table row per penalized request. Calls come from one thread (the engine's).
    """

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None  # [slots, V] int32: tokens drawn, per penalized request
        self._free_slots: list[int] = []
        self._n_slots = 0
        self._vocab_hash: torch.Tensor | None = None  # [V] int64: mix32 of each vocab id

    def open(self, params: SamplingParams) -> DrawState:
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        state = DrawState(params=params, seed=seed)
        if state.penalized:
            if self._free_slots:
                state.slot = self._free_slots.pop()
            else:
                state.slot, self._n_slots = self._n_slots, self._n_slots + 1
        return state

    def close(self, state: DrawState) -> None:
        """The request is done: its count row is zeroed (queued behind the draws that wrote it) and
        given back."""
        if state.slot is None:
            return
        if self._counts is not None and state.slot < self._counts.shape[0]:
            self._counts[state.slot].zero_()
        self._free_slots.append(state.slot)
        state.slot = None

    def sample(self, logits: torch.Tensor, states: Sequence[DrawState]) -> torch.Tensor:
        """logits [B, V] (row i belongs to states[i]) -> token ids [B] int64 on the same device."""
        n_rows, vocab = logits.shape
        assert n_rows == len(states) > 0
        device = logits.device
        logits = logits.float()
        table = self._params_table(states, device)  # [B, 8] fp64
        pen_rows = [i for i, s in enumerate(states) if s.penalized]
        pen_index = None
        if pen_rows:
            pen_index = _upload([[i, _slot(states[i])] for i in pen_rows], torch.long, device)  # [P, 2]: row, slot
            counts = self._count_table(device, vocab)[pen_index[:, 1]].float()  # [P, V]
            rows = table[pen_index[:, 0]].float()
            penalty = rows[:, 4:5] * (counts > 0) + rows[:, 5:6] * counts
            logits = logits.index_add(0, pen_index[:, 0], penalty, alpha=-1.0)
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
        return tokens

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
        """[B, 8] fp64 on the device: temperature, top_k, top_p, min_p, presence, frequency and the
        two draw keys (32-bit integers, exact in fp64). One upload for the whole batch."""
        rows = []
        for s in states:
            p = s.params
            rows.append([p.temperature, p.top_k, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                         *draw_keys(s.seed, s.n_drawn)])
        return _upload(rows, torch.float64, device)

    def _count_table(self, device: torch.device, vocab: int) -> torch.Tensor:
        """The counts table, grown (by doubling) to hold every open slot."""
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


def _slot(state: DrawState) -> int:
    assert state.slot is not None, "a penalized request has its count table row from `open`"
    return state.slot


def _upload(rows: list[list[float]] | list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host table to the device without a host wait (pinned, asynchronous on a GPU)."""
    host = torch.tensor(rows, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
