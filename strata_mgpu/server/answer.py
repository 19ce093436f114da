"""What reading a chat answer gives, and the contracts of its readers (`dialects.py` builds them).

An `AnswerReader` reads a whole answer in a model's chat format, as its text arrives: reasoning,
content and tool calls. A `CallReader` reads one call block's text, for the formats whose calls sit
between two tags (`tool_calls.ToolCallParser`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    index: int  # its place among the answer's calls, from 0
    id: str
    name: str
    arguments: str  # a JSON object's text (a broken call's: as written, `CallReader.end`)


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its head (id and name set) on the first, then arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)  # the calls' pieces, as they stream
    calls: list[ToolCall] = field(default_factory=list)  # the calls that ended


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class AnswerReader(Protocol):
    """Feed the answer's text in pieces; each `feed` and the one `finish` give what is new. Every
    split of the text gives the same reasoning, content and calls as the whole; the deltas of a
    call joined are its arguments."""

    def feed(self, text: str) -> ChatDelta: ...

    def finish(self, cut: bool) -> ChatDelta:
        """The answer has ended (`cut`: at the length limit, so a call it was in is no call, and
        no markup is left in the content)."""

    @property
    def done(self) -> bool:
        """The answer has all the calls it may have: what follows is not wanted."""

    @property
    def cut_call(self) -> bool:
        """The length limit cut a call whose head was given out (it is not among the calls)."""


class CallReader(Protocol):
    """One call block's text (between its tags), read as it arrives; fed no close tag."""

    def feed(self, text: str) -> None: ...

    @property
    def name(self) -> str | None:
        """The function's name, once the block is sure to be a call of it (its head may be sent)."""

    @property
    def arguments(self) -> str:
        """The arguments' text that may be sent so far: it only grows, and the final arguments
        (`end`'s) start with it. Empty while `name` is None."""

    @property
    def complete(self) -> bool:
        """The call's arguments have ended (a cut at the length limit after this loses nothing)."""

    def end(self, closed: bool) -> tuple[str, str] | None:
        """The block is over (`closed`: its close tag came; else the model ended the answer inside
        it): (name, arguments), or None where it is no call (only while `name` is None). The
        arguments are a JSON object's text, but for a sure call whose text broke or stopped before
        its arguments closed: then the text as the model wrote it, no JSON (never closed by
        invention)."""


class CallTags(Protocol):
    """A format whose calls sit between two tags, each read by its own `CallReader`."""

    @property
    def call_open(self) -> str: ...

    @property
    def call_close(self) -> str: ...

    def reader(self, functions: Mapping[str, dict[str, Any]] | None) -> CallReader:
        """A reader of one block. functions: each offered function's parameters schema by its
        name (a call of another name is read only once whole); None: any name."""


def partial_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if tag.startswith(text[-n:]):
                best = n
                break
    return best
