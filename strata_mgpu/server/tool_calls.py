"""Tool calls parsed out of an answer, whole or streamed, in a format whose calls sit between tags
(`answer.CallTags`: the Qwen family's and GLM's dialects, `dialects.py`).

The parser finds the blocks between the dialect's tags; a `CallReader` reads each block's text.
Text outside the blocks stays content, but for whitespace at its start or end beside a call (text
on both sides of a call keeps the whitespace before the call between them); text that may be the
start of a tag is held back until it can be told apart.

A call is given out as soon as its reader is sure of it (its function's name is read, and is one
offered): its head (index, id, name), then its arguments in deltas as the reader reads them; the
deltas joined are the call's final arguments: a JSON object's text, or, for a sure call whose
text broke, that text as the model wrote it (`CallReader.end`). A block the reader is not sure of
while it runs is read whole at its close tag: a call then, or content, tags and all (a model's
malformed call is never an error). Where the model ends the answer inside a block, the reader
ends it as it stands; a block that was not sure is content. Where the length limit cuts it
(`finish(cut=True)`), a call whose arguments had not ended is no call (`cut_call` says its head
was given out: nothing closes its streamed arguments) and a block that was not sure is dropped,
with any tag's start held back: no markup in content. Every split of the text into deltas gives
the same calls and content as the whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from strata_mgpu.server.answer import CallDelta, CallReader, CallTags, ToolCall, new_call_id, partial_tail


@dataclass
class Parsed:
    """What one `feed` (or `finish`) adds: content text, the calls' deltas, and the calls that ended
    in it, in answer order."""

    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Feed the answer's text in pieces. functions: the offered functions' parameter schemas by name
    (None: any name). `max_calls`: once that many calls are out, the rest is ignored (`done`)."""

    def __init__(self, dialect: CallTags, functions: Mapping[str, dict[str, Any]] | None = None,
                 max_calls: int | None = None):
        self._dialect = dialect
        self._functions = functions
        self._open, self._close = dialect.call_open, dialect.call_close
        self.max_calls = max_calls
        self.n_calls = 0
        self.cut_call = False  # the length limit cut a call whose head was given out
        self._text = ""  # outside a block: not yet given out (a tag's possible start)
        self._gap = ""  # whitespace given out only if content follows it
        self._block: str | None = None  # inside a block: its text so far
        self._fed = 0  # how much of the block its reader has
        self._reader: CallReader | None = None
        self._id: str | None = None  # the call's id, once its head is out
        self._given = ""  # its arguments given out
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
        else:
            self._text += delta
        while not self.done:
            if self._block is None:
                start = self._text.find(self._open)
                if start < 0:
                    keep = partial_tail(self._text, (self._open,))
                    self._content(out, self._text[:len(self._text) - keep])
                    self._text = self._text[len(self._text) - keep:]
                    break
                self._content(out, self._text[:start])
                self._block, self._fed = self._text[start + len(self._open):], 0
                self._reader, self._id, self._given = self._dialect.reader(self._functions), None, ""
                self._text = ""
            end = self._block.find(self._close, max(0, self._fed - len(self._close) + 1))
            upto = end if end >= 0 else len(self._block) - partial_tail(self._block, (self._close,))
            self._read(out, self._block[self._fed:upto])
            self._fed = upto
            if end < 0:
                break
            body, rest = self._block[:end], self._block[end + len(self._close):]
            self._end(out, body, closed=True)
            self._text = rest
        return out

    def finish(self, cut: bool = False) -> Parsed:
        """The answer has ended (`cut`: at the length limit): an open block is ended, a call
        cut before its arguments ended is dropped (`cut_call` where its head was out), held text
        is content (dropped where cut: it is a tag's start)."""
        out = Parsed()
        if self.done:
            return out
        if self._block is not None:
            reader = self._reader
            assert reader is not None
            self._read(out, self._block[self._fed:])
            self._fed = len(self._block)
            if cut and reader.name is not None and not reader.complete:
                self.cut_call = True  # its head is out: the client is told by finish_reason length
                self._block = self._reader = self._id = None
                self._gap = ""
            else:
                self._end(out, self._block, closed=False, cut=cut)
        if not cut:
            self._content(out, self._text)
        elif self._text:
            self._gap = ""  # the whitespace before a dropped tag's start goes with it
        self._text = ""
        if not self.n_calls and not self.cut_call:  # a plain answer's end whitespace is its own; beside a call, not
            out.content += self._gap
        self._gap = ""
        return out

    def _read(self, out: Parsed, text: str) -> None:
        reader = self._reader
        assert reader is not None
        if text:
            reader.feed(text)
        if reader.name is None:
            return
        if self._id is None:
            self._id = new_call_id()
            out.deltas.append(CallDelta(self.n_calls, "", self._id, reader.name))
        arguments = reader.arguments
        if len(arguments) > len(self._given):
            out.deltas.append(CallDelta(self.n_calls, arguments[len(self._given):]))
            self._given = arguments

    def _end(self, out: Parsed, body: str, closed: bool, cut: bool = False) -> None:
        reader = self._reader
        assert reader is not None
        self._block = self._reader = None
        call = reader.end(closed)
        if call is None:  # no call: the block is content as it stands (none where the answer was cut)
            if cut:
                self._gap = ""  # the whitespace before dropped markup goes with it
            else:
                self._content(out, self._open + body + (self._close if closed else ""))
            return
        name, arguments = call
        if self._id is None:
            self._id = new_call_id()
            out.deltas.append(CallDelta(self.n_calls, "", self._id, name))
        assert arguments.startswith(self._given), "a reader took back arguments it had given"
        if len(arguments) > len(self._given):
            out.deltas.append(CallDelta(self.n_calls, arguments[len(self._given):]))
        out.calls.append(ToolCall(index=self.n_calls, id=self._id, name=name, arguments=arguments))
        self.n_calls += 1
        self._after_call = True
        self._id = None

    def _content(self, out: Parsed, text: str) -> None:
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
