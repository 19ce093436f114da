"""Tool dialects: how a model family writes tool calls, as one object a server uses throughout.

A `ToolDialect` holds the tags a call sits between, the reasoning block's markers, the grammar of
one call and a reader of a call's text. Two are built, `hermes` (Qwen3, Hermes: `hermes.py`) and
`qwen3_coder` (`qwen3_coder.py`). The server picks one once, at load: `--tool-call-parser NAME`
(vLLM's names), or `auto`, from what the model's chat template writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from strata_mgpu.server import hermes, qwen3_coder


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


class ToolDialect(Protocol):
    @property
    def name(self) -> str:
        """Its --tool-call-parser name."""

    @property
    def call_open(self) -> str: ...

    @property
    def call_close(self) -> str: ...

    @property
    def think_open(self) -> str:
        """The reasoning block's open tag."""

    @property
    def think_close(self) -> str: ...

    def reader(self, functions: Mapping[str, dict[str, Any]] | None) -> CallReader:
        """A reader of one block. functions: each offered function's parameters schema by its
        name (a call of another name is read only once whole); None: any name."""

    def function_rules(self, functions: list[dict[str, Any]], *, strict: bool) -> list[str]:
        """Lark rules whose `function` is the text of one call of one of `functions`, between `call_open`
        "\\n" and "\\n" `call_close`; `strict`: the JSON schemas read strictly."""


@dataclass(frozen=True)
class Dialect:
    """A ToolDialect in the Qwen family's tags, with its own reader and grammar."""

    name: str
    read: Callable[[Mapping[str, dict[str, Any]] | None], CallReader]
    rules: Callable[[list[dict[str, Any]], bool], list[str]]
    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    think_open: str = "<think>"
    think_close: str = "</think>"

    def reader(self, functions: Mapping[str, dict[str, Any]] | None) -> CallReader:
        return self.read(functions)

    def function_rules(self, functions: list[dict[str, Any]], *, strict: bool) -> list[str]:
        return self.rules(functions, strict)


HERMES: ToolDialect = Dialect("hermes", hermes.HermesReader, hermes.function_rules)
QWEN3_CODER: ToolDialect = Dialect("qwen3_coder", qwen3_coder.Qwen3CoderReader, qwen3_coder.function_rules)
DIALECTS: dict[str, ToolDialect] = {d.name: d for d in (HERMES, QWEN3_CODER)}
AUTO = "auto"
PARSER_NAMES = (AUTO, *DIALECTS)


def dialect_of_template(source: str | None) -> ToolDialect:
    """The dialect a chat template teaches its model (hermes where it shows none)."""
    if source is not None and "<function=" in source and "<parameter=" in source:
        return QWEN3_CODER
    return HERMES


def choose_dialect(parser: str, template_source: str | None) -> ToolDialect:
    if parser == AUTO:
        return dialect_of_template(template_source)
    try:
        return DIALECTS[parser]
    except KeyError:
        raise ValueError(f"tool call parser {parser!r}: one of {', '.join(PARSER_NAMES)}") from None
