"""Token logprobs in OpenAI's two shapes: chat (`choices[].logprobs.content[]`) and legacy
completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). The numbers are the
model's log-softmax, before sampling's changes. A token's text is its bytes decoded (a piece of
a multi-byte character shows as U+FFFD; `bytes` has the exact bytes).
"""

from __future__ import annotations

import math
from typing import Any

from strata_mgpu.engine.device_sampler import TokenLogprobs
from strata_mgpu.model.tokenizer import Tokenizer

FLOOR = -9999.0  # what OpenAI reports for a probability that rounds to 0 (JSON has no -inf)


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def _token(tok: Tokenizer, token_id: int) -> tuple[str, bytes]:
    raw = tok.token_bytes(token_id, skip_special=False)
    return raw.decode("utf-8", errors="replace"), raw


def chat_entries(tok: Tokenizer, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        text, raw = _token(tok, e.token)
        top = []
        for token_id, logprob in e.top:
            t, b = _token(tok, token_id)
            top.append({"token": t, "logprob": _number(logprob), "bytes": list(b)})
        out.append({"token": text, "logprob": _number(e.logprob), "bytes": list(raw), "top_logprobs": top})
    return out


class LegacyLogprobs:
    """Legacy completions' logprobs, kept across a stream's chunks (text_offset runs on)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.offset = 0  # characters of the completion's tokens so far

    def block(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, logprobs, tops, offsets = [], [], [], []
        for e in entries:
            text, _ = _token(self.tok, e.token)
            tokens.append(text)
            logprobs.append(_number(e.logprob))
            tops.append({_token(self.tok, t)[0]: _number(lp) for t, lp in e.top})
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
