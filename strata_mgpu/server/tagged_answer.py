"""An answer in a format of tags (the Qwen family's, GLM's): a reasoning block split off first
(`reasoning.ReasoningSplitter`), then tool calls parsed out of the rest (`tool_calls.ToolCallParser`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strata_mgpu.server.answer import CallTags, ChatDelta
from strata_mgpu.server.reasoning import ReasoningSplitter
from strata_mgpu.server.tool_calls import ToolCallParser


class TaggedAnswer:
    """An `AnswerReader`. think_tags: the reasoning block's open and close tags, or None where
    reasoning stays in the content; opened: the prompt opened a block. calls: the call tags, or
    None where calls are not parsed out (`functions`, `max_calls`: as `ToolCallParser` takes them)."""

    def __init__(self, think_tags: tuple[str, str] | None, opened: bool, calls: CallTags | None,
                 functions: Mapping[str, dict[str, Any]] | None, max_calls: int | None):
        self._splitter = ReasoningSplitter(think_tags, opened) if think_tags is not None else None
        self._parser = ToolCallParser(calls, functions, max_calls) if calls is not None else None

    @property
    def done(self) -> bool:
        return self._parser is not None and self._parser.done

    @property
    def cut_call(self) -> bool:
        return self._parser is not None and self._parser.cut_call

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self._splitter.feed(text) if self._splitter else ("", text)
        return self._parsed(reasoning, content, final=False, cut=False)

    def finish(self, cut: bool) -> ChatDelta:
        reasoning, content = self._splitter.finish() if self._splitter else ("", "")
        return self._parsed(reasoning, content, final=True, cut=cut)

    def _parsed(self, reasoning: str, content: str, final: bool, cut: bool) -> ChatDelta:
        delta = ChatDelta(reasoning, content)
        if self._parser is not None:
            parsed = self._parser.feed(content)
            delta.content, delta.deltas, delta.calls = parsed.content, parsed.deltas, parsed.calls
            if final:
                rest = self._parser.finish(cut)
                delta.content += rest.content
                delta.deltas += rest.deltas
                delta.calls += rest.calls
        return delta
