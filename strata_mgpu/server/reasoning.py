"""`reasoning_content` split from a reasoning block (`<think>...</think>`, the dialect's tags), in
whole answers and in stream deltas (llama-server's `--reasoning-format deepseek`).

A reasoning block is one at the very start of the answer (after whitespace), or, where the prompt
itself opened `<think>`, everything up to the first `</think>`. `<think>` later in the answer is
content. The reasoning is given without the whitespace around it, the content without the
whitespace after `</think>`; an answer with no reasoning block keeps its text exactly. An
unterminated block is all reasoning. Tags split across deltas are held back until they can be
told apart.
"""

from __future__ import annotations

import enum

from strata_mgpu.server.answer import partial_tail


class _State(enum.Enum):
    START = "start"  # nothing but whitespace yet: a block may open
    REASONING = "reasoning"
    CONTENT = "content"


def opens_reasoning(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether the prompt leaves the answer inside a reasoning block (its last open tag unclosed)."""
    return prompt.rfind(tags[0]) > prompt.rfind(tags[1])


class ReasoningSplitter:
    """Feed the answer's text in pieces; each `feed` returns (reasoning, content) that is new.
    tags: the block's open and close tags; opened: the prompt opened a block."""

    def __init__(self, tags: tuple[str, str], opened: bool = False):
        self._open, self._close = tags
        self._state = _State.REASONING if opened else _State.START
        self._buffer = ""  # held back: a tag's possible start, or whitespace whose place is not known yet
        self._lead = True  # in reasoning or content just after a block: leading whitespace is dropped
        self.saw_block = opened

    def feed(self, delta: str) -> tuple[str, str]:
        reasoning, content = [], []
        text = self._buffer + delta
        self._buffer = ""
        while text:
            if self._state is _State.START:
                stripped = text.lstrip()
                if stripped.startswith(self._open):
                    self._state, self.saw_block, self._lead = _State.REASONING, True, True
                    text = stripped[len(self._open):]
                    continue
                if self._open.startswith(stripped):  # whitespace, or the start of the tag: wait
                    self._buffer = text
                    break
                self._state, self._lead = _State.CONTENT, False
                continue
            if self._state is _State.REASONING:
                end = text.find(self._close)
                piece = text if end < 0 else text[:end]
                if end < 0:  # hold back a possible start of the tag, and trailing whitespace
                    keep = partial_tail(piece, (self._close,))
                    body = piece[:len(piece) - keep]
                    trimmed = body.rstrip()
                    self._buffer = body[len(trimmed):] + piece[len(piece) - keep:]
                    piece = trimmed
                else:
                    piece = piece.rstrip()
                if self._lead:
                    piece = piece.lstrip()
                    self._lead = not piece
                if piece:
                    reasoning.append(piece)
                if end < 0:
                    break
                self._state, self._lead = _State.CONTENT, True
                text = text[end + len(self._close):]
                continue
            if self._lead:  # content after a block starts at its first non-whitespace
                text = text.lstrip()
                if not text:
                    break
                self._lead = False
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held back, once the answer has ended."""
        held, self._buffer = self._buffer, ""
        if self._state is _State.REASONING:  # unterminated: its trailing whitespace is dropped
            return (held.strip() if self._lead else held.rstrip()), ""
        return "", held  # before any block: the text as it came; after one: nothing is held
