"""A chat answer as the engine's text arrives, read in the served model's dialect (its
`AnswerReader`: reasoning split off, tool calls parsed out). `feed` and `finish` give what is new,
for a whole response and a stream alike; it keeps the whole for `message`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strata_mgpu.server.answer import CallDelta, ChatDelta, ToolCall
from strata_mgpu.server.dialects import ToolDialect


class ChatAnswer:
    """split_reasoning: reasoning becomes reasoning_content (`opened`: the prompt opened a block).
    parse_tools: tool calls are parsed out (`functions`: the offered ones' parameter schemas by
    name; `max_calls`: at most that many, then `done`)."""

    def __init__(self, dialect: ToolDialect, *, split_reasoning: bool, opened: bool, parse_tools: bool,
                 functions: Mapping[str, dict[str, Any]] | None = None, max_calls: int | None = None):
        self._reader = dialect.answer(split_reasoning=split_reasoning, opened=opened, parse_tools=parse_tools,
                                      functions=functions, max_calls=max_calls)
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []

    @property
    def done(self) -> bool:
        """The answer has all the calls it may have: what follows is not wanted."""
        return self._reader.done

    @property
    def cut_call(self) -> bool:
        """The length limit cut a call whose head was given out (it is not among `calls`)."""
        return self._reader.cut_call

    def feed(self, text: str) -> ChatDelta:
        return self._record(self._reader.feed(text))

    def finish(self, cut: bool = False) -> ChatDelta:
        """The answer has ended (`cut`: at the length limit, so a call it was in is no call, nor content)."""
        return self._record(self._reader.finish(cut))

    def _record(self, delta: ChatDelta) -> ChatDelta:
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
