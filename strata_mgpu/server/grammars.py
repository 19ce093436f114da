"""The grammars of the API's constraints, as llguidance Lark text (compiled by `engine.grammar`).

- `tool_choice` required: one or more tool calls in the served model's dialect, "\\n" between
  calls, each call's arguments following its function's `parameters` schema; a named function:
  calls of that function only; `parallel_tool_calls` false: exactly one call. With tool_choice
  auto and a JSON response_format, the answer is either tool calls or the JSON.
- A chat that may think first gets the reasoning block free ahead of the constrained answer:
  optional where the model opens it itself, required to close where the prompt already opened
  it, absent where thinking is off or `--reasoning-format none` leaves the tags in the content.

A tag the vocabulary holds as one token (`<tool_call>`, `<think>`, gpt-oss's `<|channel|>`) is
matched as that token, as the model writes it; the dialect (`dialects.ToolDialect`) gives the
markup around calls, reasoning and a JSON answer.
"""

from __future__ import annotations

import enum
import json
import threading
from collections.abc import Callable
from typing import Any

from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.grammar import GrammarCompiler
from strata_mgpu.model.tokenizer import Tokenizer
from strata_mgpu.server.dialects import ToolDialect
from strata_mgpu.server.json_schema import json_rule


class Thinking(enum.Enum):
    """Where the constrained answer may start."""

    OFF = "off"  # at once
    OPTIONAL = "optional"  # after a reasoning block, if the model opens one
    OPENED = "opened"  # after the close tag of the block the prompt opened


def chat_grammar(tok: Tokenizer, dialect: ToolDialect, *, functions: list[dict[str, Any]] | None, parallel: bool,
                 answer_schema: dict[str, Any] | None, thinking: Thinking, strict: bool = True) -> str | None:
    """The grammar of a chat answer, or None where nothing constrains it.

    functions: the callable functions when a call is required (one: that one is named), else None.
    answer_schema: the JSON schema of a JSON response_format. With both, the answer is calls or JSON."""
    if functions is None and answer_schema is None:
        return None
    markup = _markup_of(tok)
    rules = []
    answers = []
    if functions is not None:
        rules += dialect.calls_rules(functions, parallel=parallel, strict=strict, markup=markup)
        answers.append("calls")
    if answer_schema is not None:
        head = f"{markup(dialect.json_head)} " if dialect.json_head else ""
        rules.append(f"json_answer: {head}" + json_rule(answer_schema, strict=strict))
        answers.append("json_answer")
    answer = " | ".join(answers)
    lead = f"{markup(dialect.lead)}? " if dialect.lead else ""
    if thinking is Thinking.OFF:
        return "\n".join([f"start: {lead}({answer})", *rules]) + "\n"
    close = dialect.think_close
    if _token_at(tok, close, 0) is not None:  # it starts with a token no text spells: any text before it
        rules.append(f'reasoning: /(.|\\n)*/ {markup(close)} /[ \\n]+/?')
    else:  # a text tag: the reasoning ends at its first occurrence
        rules.append(f'reasoning[lazy]: /(?s:.*){_regex_text(close)}[ \\n]*/')
    if thinking is Thinking.OPENED:
        start = f"start: reasoning ({answer})"
    else:
        start = f"start: {lead}({markup(dialect.think_open)} reasoning)? ({answer})"
    return "\n".join([start, *rules]) + "\n"


def text_grammar(answer_schema: dict[str, Any] | None, strict: bool = True) -> str | None:
    """The grammar of a text completion: its JSON response_format from the first token."""
    return None if answer_schema is None else \
        f"start: json_answer\njson_answer: {json_rule(answer_schema, strict=strict)}\n"


_REGEX_META = frozenset("\\.+*?()|[]{}^$/#&~-")


def _regex_text(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _token_at(tok: Tokenizer, text: str, at: int) -> str | None:
    """The longest added token (llguidance names those `<...>`) that `text` holds at `at`, or None."""
    best = None
    for i in tok.added_ids:
        token = tok.tokens[i]
        if text.startswith(token, at) and (best is None or len(token) > len(best)):
            best = token
    return best


def _markup_of(tok: Tokenizer) -> Callable[[str], str]:
    """Markup text -> its grammar terms: each added token it holds as that token, the text between
    as string literals (`<|channel|>final<|message|>` -> `<|channel|> "final" <|message|>`)."""
    def markup(text: str) -> str:
        terms, literal, at = [], "", 0
        while at < len(text):
            token = _token_at(tok, text, at)
            if token is None:
                literal += text[at]
                at += 1
                continue
            if literal:
                terms.append(json.dumps(literal, ensure_ascii=False))
                literal = ""
            terms.append(token)
            at += len(token)
        if literal:
            terms.append(json.dumps(literal, ensure_ascii=False))
        return " ".join(terms)
    return markup


class Grammars:
    """The grammar compiler of the engine being served, made at its first use (llguidance reads the
    whole vocabulary)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._compiler: GrammarCompiler | None = None

    def compiler(self, engine: Engine) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None or self._engine is not engine:
                self._compiler = GrammarCompiler(engine.tokenizer, engine.runner.spec.vocab_size)
                self._engine = engine
            return self._compiler
