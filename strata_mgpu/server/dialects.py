"""Tool dialects: how a model family writes its answers (reasoning, tool calls), as one object a
server uses throughout.

A `ToolDialect` reads an answer (`answer`: an `answer.AnswerReader`), holds the grammar of its
calls, the reasoning block's markers and the control tokens its answers are read by. Four are
built: `hermes` (Qwen3, Hermes: `hermes.py`), `qwen3_coder` (`qwen3_coder.py`), `glm45` (GLM-4.5:
`glm45.py`), all of the tagged kind (`TaggedDialect`: calls between `<tool_call>` tags, reasoning
in `<think>`), and `harmony` (gpt-oss's channels: `harmony.py`). The server picks one once, at
load: `--tool-call-parser NAME` (vLLM's names), or `auto`, from what the model's chat template
writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from strata_mgpu.server import glm45, harmony, hermes, qwen3_coder
from strata_mgpu.server.answer import AnswerReader, CallReader
from strata_mgpu.server.tagged_answer import TaggedAnswer

Markup = Callable[[str], str]  # a piece of markup -> the grammar's term for it (added tokens matched as tokens)
Readers = Callable[[Mapping[str, dict[str, Any]] | None], CallReader]
FunctionRules = Callable[[list[dict[str, Any]], bool, Markup], list[str]]


class ToolDialect(Protocol):
    @property
    def name(self) -> str:
        """Its --tool-call-parser name."""

    @property
    def think_open(self) -> str:
        """The markup that opens a reasoning block (a prompt that ends inside one opened it)."""

    @property
    def think_close(self) -> str:
        """The markup that closes it; what follows is the answer proper."""

    @property
    def lead(self) -> str:
        """What the model writes before its answer starts ("" or a newline)."""

    @property
    def json_head(self) -> str:
        """The markup a JSON answer (response_format) follows."""

    @property
    def call_token(self) -> str | None:
        """The added token whose ban keeps the model from calling (tool_choice none), or None."""

    @property
    def shown_markup(self) -> tuple[str, ...]:
        """The tokens its answers are read by: a vocabulary's control tokens among them are decoded
        as text (`Tokenizer.show_markup`)."""

    def answer(self, *, split_reasoning: bool, opened: bool, parse_tools: bool,
               functions: Mapping[str, dict[str, Any]] | None, max_calls: int | None) -> AnswerReader:
        """A reader of one answer. split_reasoning: reasoning becomes reasoning_content (opened: the
        prompt opened a block); parse_tools: calls are parsed out (functions: the offered ones'
        parameter schemas by name, None: any; max_calls: at most that many)."""

    def calls_rules(self, functions: list[dict[str, Any]], *, parallel: bool, strict: bool,
                    markup: Markup) -> list[str]:
        """Lark rules whose `calls` is one call of one of `functions` (`parallel`: one or more), as
        the answer after any reasoning writes it; `strict`: the JSON schemas read strictly."""

    def adapt_history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the template reads them (`messages.template_messages`'s), with the model's
        own past answers, as this server gave them out, in the form its template renders as the model
        wrote them (where the template refuses that form as given); as given for the other messages."""


def _rules_of_text(rules: Callable[[list[dict[str, Any]], bool], list[str]]) -> FunctionRules:
    """Function rules of a dialect whose markup inside a call is plain text (it needs no `Markup`)."""
    return lambda functions, strict, _markup: rules(functions, strict)


@dataclass(frozen=True)
class TaggedDialect:
    """A ToolDialect whose calls sit between two tags (with `frame` inside them around a call's text)
    and whose reasoning is one block between two tags, each call read by its own reader."""

    name: str
    read: Readers
    rules: FunctionRules
    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    think_open: str = "<think>"
    think_close: str = "</think>"
    frame: tuple[str, str] = ("\n", "\n")  # between the open tag and a call's text, and before the close tag
    lead: str = ""
    markup_inside: tuple[str, ...] = ()  # the tags a call's text holds
    json_head: str = ""

    @property
    def call_token(self) -> str:
        return self.call_open

    @property
    def shown_markup(self) -> tuple[str, ...]:
        return (self.call_open, self.call_close, self.think_open, self.think_close, *self.markup_inside)

    def reader(self, functions: Mapping[str, dict[str, Any]] | None) -> CallReader:
        return self.read(functions)

    def answer(self, *, split_reasoning: bool, opened: bool, parse_tools: bool,
               functions: Mapping[str, dict[str, Any]] | None, max_calls: int | None) -> AnswerReader:
        return TaggedAnswer((self.think_open, self.think_close) if split_reasoning else None, opened,
                            self if parse_tools else None, functions, max_calls)

    def calls_rules(self, functions: list[dict[str, Any]], *, parallel: bool, strict: bool,
                    markup: Markup) -> list[str]:
        before, after = (f"{markup(text)} " if text else "" for text in self.frame)
        calls = 'call ("\\n" call)*' if parallel else "call"
        return [f"calls: {calls}",
                f"call: {markup(self.call_open)} {before}function {after}{markup(self.call_close)}",
                *self.rules(functions, strict, markup)]

    def adapt_history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return messages  # a tagged template takes an answer's content, reasoning and calls together


HERMES = TaggedDialect("hermes", hermes.HermesReader, _rules_of_text(hermes.function_rules))
QWEN3_CODER = TaggedDialect("qwen3_coder", qwen3_coder.Qwen3CoderReader, _rules_of_text(qwen3_coder.function_rules))
GLM45 = TaggedDialect("glm45", glm45.Glm45Reader, glm45.function_rules, frame=("", ""), lead="\n",
                      markup_inside=glm45.MARKUP)
HARMONY = harmony.HarmonyDialect()
DIALECTS: dict[str, ToolDialect] = {d.name: d for d in (HERMES, QWEN3_CODER, GLM45, HARMONY)}
AUTO = "auto"
PARSER_NAMES = (AUTO, *DIALECTS)


def dialect_of_template(source: str | None) -> ToolDialect:
    """The dialect a chat template teaches its model (hermes where it shows none)."""
    if source is None:
        return HERMES
    if "<|channel|>" in source and "<|message|>" in source:
        return HARMONY
    if "<arg_key>" in source and "<arg_value>" in source:
        return GLM45
    if "<function=" in source and "<parameter=" in source:
        return QWEN3_CODER
    return HERMES


def choose_dialect(parser: str, template_source: str | None) -> ToolDialect:
    if parser == AUTO:
        return dialect_of_template(template_source)
    try:
        return DIALECTS[parser]
    except KeyError:
        raise ValueError(f"tool call parser {parser!r}: one of {', '.join(PARSER_NAMES)}") from None
