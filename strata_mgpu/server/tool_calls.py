"""Tool calls parsed out of an answer in the Hermes/Qwen3 form, whole or streamed.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each well-formed block becomes a `ToolCall` (an id `call_...`, the function's name, its arguments
as a JSON string: the object's text as the model wrote it, or the string it gave); several blocks
are several calls. Text outside the blocks stays content, but for whitespace at its start or end
beside a call (text on both sides of a call keeps the whitespace before the call between them).
A block that is not a JSON object with a string `name` and object (or JSON-string) `arguments`,
or that never closes, comes back as content, tags and all: a model's malformed call is never an
error. Streamed, a call is given once its `</tool_call>` has arrived (only then is it known to be
well formed), its arguments in the pieces they arrived in; text that may be the start of a tag is
held back until it can be told apart.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    index: int  # its place among the answer's calls, from 0
    id: str
    name: str
    arguments: str  # JSON text
    pieces: tuple[str, ...]  # `arguments` as it arrived, piece by piece (joined, they are it)


@dataclass
class Parsed:
    """What one `feed` (or `finish`) adds: content text, then complete calls, in answer order."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _partial_tail(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Feed the answer's text in pieces. `max_calls` (1 for parallel_tool_calls false): once that
    many calls are out, the rest of the answer is ignored (`done`)."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.n_calls = 0
        self._text = ""  # outside a block: not yet given out (a tag's possible start)
        self._gap = ""  # whitespace given out only if content follows it
        self._block: str | None = None  # inside a block: its text so far
        self._cuts: list[int] = []  # where in the block each delta ended
        self._after_call = False  # whitespace right after a call separates, it is not content

    @property
    def done(self) -> bool:
        return self.max_calls is not None and self.n_calls >= self.max_calls

    def feed(self, delta: str) -> Parsed:
        out = Parsed()
        if self.done:
            return out
        if self._block is not None:
            self._block += delta
            self._cuts.append(len(self._block))
        else:
            self._text += delta
        while not self.done:
            if self._block is None:
                start = self._text.find(OPEN)
                if start < 0:
                    keep = _partial_tail(self._text, OPEN)
                    self._content(out, self._text[:len(self._text) - keep])
                    self._text = self._text[len(self._text) - keep:]
                    break
                self._content(out, self._text[:start])
                self._block, self._cuts = self._text[start + len(OPEN):], []
                self._cuts.append(len(self._block))
                self._text = ""
            end = self._block.find(CLOSE)
            if end < 0:
                break
            body, rest = self._block[:end], self._block[end + len(CLOSE):]
            call = self._call(body)
            if call is None:  # malformed: the block is content as it stands
                self._content(out, OPEN + body + CLOSE)
            else:
                out.calls.append(call)
                self.n_calls += 1
                self._after_call = True
            self._block, self._text = None, rest
        return out

    def finish(self) -> Parsed:
        """The answer has ended: an open block and any held text are content."""
        out = Parsed()
        if self.done:
            return out
        if self._block is not None:
            self._content(out, OPEN + self._block)
            self._block = None
        self._content(out, self._text)
        self._text = ""
        if not self.n_calls:  # whitespace at the very end of a plain answer is its own; beside a call, not
            out.content += self._gap
        self._gap = ""
        return out

    def _content(self, out: Parsed, text: str) -> None:
        """Give out text outside the blocks; whitespace at its end waits for what follows it."""
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.content += self._gap + body
            self._gap = text[len(body):]
        else:
            self._gap += text

    def _call(self, body: str) -> ToolCall | None:
        parsed = _parse_call(body)
        if parsed is None:
            return None
        name, arguments, span = parsed
        if span is None:
            pieces: tuple[str, ...] = (arguments,)
        else:
            a, b = span
            cuts = [a, *(c for c in self._cuts if a < c < b), b]
            pieces = tuple(body[x:y] for x, y in zip(cuts, cuts[1:], strict=False) if y > x)
        return ToolCall(index=self.n_calls, id=new_call_id(), name=name, arguments=arguments, pieces=pieces)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _parse_call(body: str) -> tuple[str, str, tuple[int, int] | None] | None:
    """(name, arguments JSON, the arguments' span in body, None where they were a JSON string)."""
    decoder = json.JSONDecoder()
    start = _skip_space(body, 0)
    try:
        obj, end = decoder.raw_decode(body, start)
    except json.JSONDecodeError:
        return None
    if body[end:].strip() or not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # arguments given as a JSON string: it must hold an object
        try:
            inner = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return (obj["name"], arguments, None) if isinstance(inner, dict) else None
    if not isinstance(arguments, dict):
        return None
    span = _value_span(body, start, "arguments")
    if span is None:  # no "arguments" key: a call without arguments
        return obj["name"], "{}", None
    return obj["name"], body[span[0]:span[1]], span


def _value_span(text: str, i: int, key: str) -> tuple[int, int] | None:
    """The span of the value of `key` in the JSON object at text[i] (known to be valid); the
    last one where the key repeats, as json.loads keeps."""
    decoder = json.JSONDecoder()
    found = None
    i = _skip_space(text, i) + 1  # past '{'
    while True:
        i = _skip_space(text, i)
        if text[i] == "}":
            return found
        name, i = decoder.raw_decode(text, i)
        i = _skip_space(text, i) + 1  # past ':'
        a = _skip_space(text, i)
        _, b = decoder.raw_decode(text, a)
        if name == key:
            found = (a, b)
        i = _skip_space(text, b)
        if text[i] == ",":
            i += 1
