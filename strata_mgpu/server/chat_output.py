"""A chat answer as the engine's text arrives: reasoning split off, then tool calls parsed out of
the rest, in the served model's tool dialect. `feed` and `finish` give what is new, for a whole
response and a stream alike; it keeps the whole for `message`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from strata_mgpu.server.dialects import ToolDialect
from strata_mgpu.server.reasoning import ReasoningSplitter
from strata_mgpu.server.tool_calls import CallDelta, ToolCall, ToolCallParser


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)  # the calls' pieces, as they stream
    calls: list[ToolCall] = field(default_factory=list)  # the calls that ended


class ChatAnswer:
    """split_reasoning: reasoning blocks become reasoning_content (`opened`: the prompt opened one).
    parse_tools: tool calls are parsed out (`functions`: the offered ones' parameter schemas by
    name; `max_calls`: at most that many, then `done`)."""

    def __init__(self, dialect: ToolDialect, *, split_reasoning: bool, opened: bool, parse_tools: bool,
                 functions: Mapping[str, dict[str, Any]] | None = None, max_calls: int | None = None):
        tags = (dialect.think_open, dialect.think_close)
        self._splitter = ReasoningSplitter(tags, opened) if split_reasoning else None
        self._parser = ToolCallParser(dialect, functions, max_calls) if parse_tools else None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []

    @property
    def done(self) -> bool:
        """The answer has all the calls it may have: what follows is not wanted."""
        return self._parser is not None and self._parser.done

    @property
    def cut_call(self) -> bool:
        """The length limit cut a call whose head was given out (it is not among `calls`)."""
        return self._parser is not None and self._parser.cut_call

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self._splitter.feed(text) if self._splitter else ("", text)
        return self._record(reasoning, content, final=False, cut=False)

    def finish(self, cut: bool = False) -> ChatDelta:
        """The answer has ended (`cut`: at the length limit, so a call it was in is no call, nor content)."""
        reasoning, content = self._splitter.finish() if self._splitter else ("", "")
        return self._record(reasoning, content, final=True, cut=cut)

    def _record(self, reasoning: str, content: str, final: bool, cut: bool) -> ChatDelta:
        delta = ChatDelta(reasoning, content)
        if self._parser is not None:
            parsed = self._parser.feed(content)
            delta.content, delta.deltas, delta.calls = parsed.content, parsed.deltas, parsed.calls
            if final:
                rest = self._parser.finish(cut)
                delta.content += rest.content
                delta.deltas += rest.deltas
                delta.calls += rest.calls
        self.reasoning.append(delta.reasoning)
        self.content.append(delta.content)
        self.calls += delta.calls
        return delta

    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        reasoning = "".join(self.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = [tool_call_json(c) for c in self.calls]
        return message


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta(piece: CallDelta) -> dict[str, Any]:
    """A call's piece as OpenAI streams it: index, id, type and name once, then the arguments."""
    if piece.id is not None:
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                "function": {"name": piece.name, "arguments": piece.arguments}}]}
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]}
