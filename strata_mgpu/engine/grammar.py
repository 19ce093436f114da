"""Grammars that constrain what a request may generate: llguidance, compiled once per grammar text.

Shape legend: M = constrained rows, W = mask words (ceil(V / 32)), V = vocab.

A grammar's text is llguidance's Lark dialect (`%json {...}` for schemas, `<name>` for added
tokens). Compiled grammars are kept in an LRU by their text; each request copies the compiled
matcher. A mask row holds bit j of word w for vocab id 32 w + j. The masks are the host's work
(`fill_bitmasks`); `allowed_tokens` expands them on the logits' device.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import torch

from strata_mgpu.model.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept (a tool set or a schema a client repeats is compiled once)
PARALLEL_FROM = 16  # masks of this many rows or more are filled on llguidance's threads (fewer: one loop is faster)


class GrammarError(ValueError):
    """A grammar that does not compile (an unsupported schema, a Lark syntax error): one line."""


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    @property
    def done(self) -> bool:
        """No token but end-of-sequence can follow (the grammar has ended, or refused a token)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def accept(self, token: int) -> bool:
        """Advance by a drawn token; False if the grammar refuses it (it then stays done)."""
        return self._matcher.consume_token(token)

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the next allowed tokens' bits into row [W] int32 (contiguous, on the host)."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    @property
    def native(self) -> llguidance.LLMatcher:
        return self._matcher


class Grammar:
    """A compiled grammar: each request takes a copy of its matcher."""

    def __init__(self, text: str, matcher: llguidance.LLMatcher, vocab_size: int):
        self.text = text
        self.vocab_size = vocab_size
        self._pristine = matcher

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._pristine.deep_copy())


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocab (the logits' width); thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        eos = sorted(tokenizer.eot_ids) or None
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size, eos_token=eos)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, lark: str) -> Grammar:
        """The grammar of a Lark text; raises GrammarError."""
        with self._lock:
            cached = self._cache.get(lark)
            if cached is not None:
                self._cache.move_to_end(lark)
                return cached
        # outside the lock: a large schema compiles for a while (llguidance drops the GIL meanwhile)
        matcher = llguidance.LLMatcher(self.tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        grammar = Grammar(lark, matcher, self.vocab_size)
        with self._lock:
            self._cache[lark] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._cache)


_executor: llguidance.LLExecutor | None = None


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bits: torch.Tensor) -> None:
    """The next masks of `matchers` into bits [M, W] int32 (host, contiguous): row i is matchers[i]'s."""
    global _executor
    assert bits.dtype == torch.int32 and bits.is_contiguous() and bits.shape[0] == len(matchers)
    if len(matchers) < PARALLEL_FROM:
        for i, m in enumerate(matchers):
            m.fill_mask(bits[i])
        return
    if _executor is None:
        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m.native, i) for i, m in enumerate(matchers)], bits.data_ptr(),
                                      bits.shape[1] * 4, bits.shape[0])


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


assert sys.byteorder == "little", "allowed_tokens reads the mask's words byte by byte, little-endian"
_BYTE_BITS: dict[torch.device, torch.Tensor] = {}  # device -> [256, 8] uint8: the bits of each byte value


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bits [M, W] int32 (any device) -> allowed [M, V] bool on the same device. The words are
    little-endian, so byte k of word w holds ids 32 w + 8 k.. in its bits 0..7; each byte looks its
    8 bits up in a table."""
    table = _BYTE_BITS.get(bits.device)
    if table is None:
        values = torch.arange(256, device=bits.device)
        table = _BYTE_BITS[bits.device] = ((values[:, None] >> torch.arange(8, device=bits.device)) & 1).to(torch.uint8)
    per_byte = bits.view(torch.uint8).long()  # [M, 4 W]
    return torch.nn.functional.embedding(per_byte, table).reshape(bits.shape[0], -1)[:, :vocab_size].bool()


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0] if lines else "the grammar does not compile"
