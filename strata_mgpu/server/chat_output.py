"""A chat answer as the engine's text arrives: reasoning split off, then tool calls parsed out of
the rest (each step only where the request has it on). One object serves a whole response and a
stream alike: `feed` and `finish` give what is new, and it keeps the whole for `message`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata_mgpu.server.reasoning import ReasoningSplitter
from strata_mgpu.server.tool_calls import ToolCall, ToolCallParser


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChatAnswer:
    """split_reasoning: `<think>` blocks become reasoning_content (`opened`: the prompt opened one).
    parse_tools: tool calls are parsed out (`max_calls`: at most that many, then `done`)."""

    def __init__(self, *, split_reasoning: bool, opened: bool, parse_tools: bool, max_calls: int | None = None):
        self._splitter = ReasoningSplitter(opened) if split_reasoning else None
        self._parser = ToolCallParser(max_calls) if parse_tools else None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []

    @property
    def done(self) -> bool:
        """The answer has all the calls it may have: what follows is not wanted."""
        return self._parser is not None and self._parser.done

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self._splitter.feed(text) if self._splitter else ("", text)
        return self._record(reasoning, *self._parse(content, final=False))

    def finish(self) -> ChatDelta:
        reasoning, content = self._splitter.finish() if self._splitter else ("", "")
        return self._record(reasoning, *self._parse(content, final=True))

    def _parse(self, content: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self._parser is None:
            return content, []
        parsed = self._parser.feed(content)
        text, calls = parsed.content, parsed.calls
        if final:
            rest = self._parser.finish()
            text, calls = text + rest.content, calls + rest.calls
        return text, calls

    def _record(self, reasoning: str, content: str, calls: list[ToolCall]) -> ChatDelta:
        self.reasoning.append(reasoning)
        self.content.append(content)
        self.calls += calls
        return ChatDelta(reasoning, content, calls)

    def message(self) -> dict[str, Any]:
        """The whole answer as an OpenAI assistant message (reasoning_content where there was any)."""
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


def tool_call_deltas(call: ToolCall) -> list[dict[str, Any]]:
    """A call as OpenAI streams it: index, id, type and name once, then the arguments in pieces."""
    head = {"index": call.index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{"tool_calls": [head]},
            *({"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]} for piece in call.pieces)]
