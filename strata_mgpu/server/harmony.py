"""gpt-oss's harmony format: an answer is a run of messages, each a header, `<|message|>` and a body,

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

(no newlines between messages; the generation prompt ends `<|start|>assistant`, and `<|call|>` or
`<|return|>`, which end the turn, never reach the text). A header names its channel after
`<|channel|>` and may name a recipient (`to=functions.NAME`, before or after the channel, as
gpt-oss's template and the model write it). Read as vLLM and llama.cpp read it:

- the `analysis` channel is reasoning (content where reasoning is not split off);
- a message to `functions.NAME` is a tool call, its body the arguments' JSON;
- any other message (`final`, `commentary` without a recipient: a preamble) is content.

A body ends at `<|end|>`, at the next `<|start|>` or `<|channel|>`, or with the answer. Streamed:
reasoning and content as they arrive (a tag's possible start held back); a call to an offered
function is sure at its header's end (its head may be sent) and its arguments are given out as
far as they are well formed (`json_prefix.JsonPrefix`). A sure call whose JSON breaks, or whose
answer ends before the JSON closes, keeps its body as the model wrote it (no JSON: nothing is
invented to close it); the length limit cutting it leaves it no call (`cut_call`). A call to a
function not offered is read once whole at its end (a call where its body is a JSON object,
else content). Text that starts no header (a model that writes no markup) is content as it
stands; a header the answer ends inside is dropped.

Sent back in a later request's history, an answer that held analysis, a preamble and a call keeps
its analysis and drops its preamble, the nearest form gpt-oss's template renders (`_without_preamble`).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from strata_mgpu.server import model_json
from strata_mgpu.server.answer import AnswerReader, CallDelta, ChatDelta, ToolCall, new_call_id, partial_tail
from strata_mgpu.server.json_prefix import JsonPrefix
from strata_mgpu.server.json_schema import json_rule

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
_BODY_ENDS = (END, START, CHANNEL, CALL, RETURN)
HEAD_LIMIT = 512  # a header ends within this many characters
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
FUNCTIONS = "functions."
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}



def _may_open_header(text: str) -> bool:
    """Whether `text` (from a message's start) is, or may grow into, a header's start: whitespace,
    an optional `<|start|>` and role, then `<|channel|>` or a recipient."""
    rest = text.lstrip()
    for prefix in (START, "assistant"):
        if prefix.startswith(rest):
            return True
        rest = rest.removeprefix(prefix).lstrip()
    return any(mark.startswith(rest) or rest.startswith(mark) for mark in (CHANNEL, "to="))


class _Kind(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"  # to an offered function: streamed
    OTHER_CALL = "other call"  # to a function not offered: read whole


class _Mode(enum.Enum):
    HEADER = "header"
    BODY = "body"
    PLAIN = "plain"  # the answer is no harmony: the rest is content as it stands


class HarmonyAnswer:
    """An `AnswerReader` of harmony (see the module's docstring)."""

    def __init__(self, split_reasoning: bool, parse_tools: bool, functions: Mapping[str, dict[str, Any]] | None,
                 max_calls: int | None):
        self._split = split_reasoning
        self._tools = parse_tools
        self._names = None if functions is None else frozenset(functions)
        self._max_calls = max_calls
        self._mode = _Mode.HEADER
        self._text = ""  # not yet read: a header, or a body's held-back tail
        self._kind = _Kind.CONTENT
        self._name = ""
        self._body = ""  # a call's body so far
        self._json = JsonPrefix()
        self._id: str | None = None
        self._given = ""  # a sure call's arguments given out
        self.n_calls = 0
        self._cut_call = False

    @property
    def done(self) -> bool:
        return self._max_calls is not None and self.n_calls >= self._max_calls

    @property
    def cut_call(self) -> bool:
        return self._cut_call

    def feed(self, text: str) -> ChatDelta:
        out = ChatDelta()
        if self.done:
            return out
        self._text += text
        while not self.done and self._text:
            if self._mode is _Mode.PLAIN:
                out.content += self._text
                self._text = ""
            elif self._mode is _Mode.HEADER:
                if not self._read_header(out):
                    break
            elif not self._read_body(out):
                break
        return out

    def finish(self, cut: bool) -> ChatDelta:
        out = ChatDelta()
        if self.done:
            return out
        if self._mode is _Mode.PLAIN:
            out.content += self._text
        elif self._mode is _Mode.BODY:
            if not cut:
                self._emit(out, self._text)
            elif self._kind in (_Kind.REASONING, _Kind.CONTENT):
                self._emit(out, self._text[:len(self._text) - partial_tail(self._text, _BODY_ENDS)])
            if cut and self._kind is _Kind.CALL and self._json.end is None:
                self._cut_call = self._id is not None  # its head is out: the client is told by finish_reason
            elif cut and self._kind is _Kind.OTHER_CALL:
                pass  # a call not offered, cut before its end: none
            else:
                self._end_message(out)
        self._text = ""  # a header the answer ended inside is markup: dropped
        return out

    # -- headers --

    def _read_header(self, out: ChatDelta) -> bool:
        """Read a header that has arrived (True), or wait for the rest of it (False)."""
        at = self._text.find(MESSAGE)
        # the header so far (less what may be the start of `<|message|>`)
        head = self._text[:len(self._text) - partial_tail(self._text, (MESSAGE,))] if at < 0 else self._text[:at]
        if not _may_open_header(head) or len(head) > HEAD_LIMIT:
            self._mode = _Mode.PLAIN  # no header: the text is the model's own
            return True
        if at < 0:
            return False
        self._text = self._text[at + len(MESSAGE):]
        self._mode = _Mode.BODY
        recipient = _RECIPIENT.search(head)
        channel = _CHANNEL.search(head)
        if recipient is not None and recipient[1].startswith(FUNCTIONS) and self._tools:
            self._name = recipient[1][len(FUNCTIONS):]
            sure = model_json.encodes(self._name) and (self._names is None or self._name in self._names)
            self._kind = _Kind.CALL if sure else _Kind.OTHER_CALL
            self._body, self._json, self._given = "", JsonPrefix(), ""
            if sure:
                self._id = new_call_id()
                out.deltas.append(CallDelta(self.n_calls, "", self._id, self._name))
        elif recipient is None and channel is not None and channel[1] == "analysis" and self._split:
            self._kind = _Kind.REASONING
        else:
            self._kind = _Kind.CONTENT
        return True

    # -- bodies --

    def _read_body(self, out: ChatDelta) -> bool:
        """Read the body up to its end (True: a header follows), or all that is sure not to be a tag (False)."""
        ends = [(i, tag) for tag in _BODY_ENDS if (i := self._text.find(tag)) >= 0]
        if not ends:
            keep = partial_tail(self._text, _BODY_ENDS)
            self._emit(out, self._text[:len(self._text) - keep])
            self._text = self._text[len(self._text) - keep:]
            return False
        at, tag = min(ends)
        self._emit(out, self._text[:at])
        # a header follows: `<|start|>` and `<|channel|>` begin it, `<|end|>` (and a turn's end) precede it
        self._text = self._text[at:] if tag in (START, CHANNEL) else self._text[at + len(tag):]
        self._end_message(out)
        self._mode = _Mode.HEADER
        return True

    def _emit(self, out: ChatDelta, text: str) -> None:
        if not text:
            return
        if self._kind is _Kind.REASONING:
            out.reasoning += text
        elif self._kind is _Kind.CONTENT:
            out.content += text
        else:
            self._body += text
            if self._kind is _Kind.CALL:
                self._json.feed(self._body[self._json.n:])
                arguments = self._json.text[:self._json.safe_text]
                if len(arguments) > len(self._given):
                    out.deltas.append(CallDelta(self.n_calls, arguments[len(self._given):]))
                    self._given = arguments

    def _end_message(self, out: ChatDelta) -> None:
        if self._kind is _Kind.CALL:
            if self._json.end is not None:
                arguments = self._json.text
            else:  # broken or unterminated: the rest as the model wrote it (no JSON, nothing closed)
                arguments = self._given + self._body[self._json.safe:].rstrip()
            self._call(out, arguments)
        elif self._kind is _Kind.OTHER_CALL:
            try:
                value = model_json.loads(self._body)
            except ValueError:
                value = None
            if isinstance(value, dict) and model_json.encodes(self._name):
                self._id = new_call_id()
                out.deltas.append(CallDelta(self.n_calls, "", self._id, self._name))
                self._call(out, model_json.dumps(value))
            else:
                out.content += self._body
        self._kind, self._body = _Kind.CONTENT, ""

    def _call(self, out: ChatDelta, arguments: str) -> None:
        assert self._id is not None and arguments.startswith(self._given), "a call's arguments only grow"
        if len(arguments) > len(self._given):
            out.deltas.append(CallDelta(self.n_calls, arguments[len(self._given):]))
        out.calls.append(ToolCall(index=self.n_calls, id=self._id, name=self._name, arguments=arguments))
        self.n_calls += 1
        self._id, self._given = None, ""


@dataclass(frozen=True)
class HarmonyDialect:
    """The ToolDialect of gpt-oss. Its reasoning block (for the grammar and for telling whether a
    prompt opened one) is an analysis message up to the next assistant message's start."""

    name: str = "harmony"
    think_open: str = CHANNEL + "analysis" + MESSAGE
    think_close: str = END + START + "assistant"
    lead: str = ""
    json_head: str = CHANNEL + "final" + MESSAGE
    call_token: str | None = None  # a call is a message like any other: no token of its own to ban
    shown_markup: tuple[str, ...] = (START, CHANNEL, MESSAGE, CONSTRAIN, END)

    def answer(self, *, split_reasoning: bool, opened: bool, parse_tools: bool,
               functions: Mapping[str, dict[str, Any]] | None, max_calls: int | None) -> AnswerReader:
        return HarmonyAnswer(split_reasoning, parse_tools, functions, max_calls)

    def calls_rules(self, functions: list[dict[str, Any]], *, parallel: bool, strict: bool,
                    markup: Callable[[str], str]) -> list[str]:
        """One call (a call ends the turn), as the model writes it:
        `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` and the arguments."""
        rules = ["calls: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
        for i, function in enumerate(functions):
            head = f"{markup(CHANNEL)} " + json.dumps(f"commentary to={FUNCTIONS}{function['name']} ",
                                                      ensure_ascii=False) + \
                f' {markup(CONSTRAIN)} "json" {markup(MESSAGE)}'
            rules += [f"fn{i}: {head} fn{i}_arguments",
                      f"fn{i}_arguments: " + json_rule(function.get("parameters") or NO_PARAMETERS, strict=strict)]
        return rules

    def adapt_history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An assistant message with calls that holds both reasoning and content (this server's answer
        of an analysis message, a preamble, then a call) keeps its reasoning and loses its content."""
        return [_without_preamble(m) for m in messages]


def _without_preamble(message: dict[str, Any]) -> dict[str, Any]:
    """The message, less its preamble where it is a past call holding both a preamble and analysis.

    gpt-oss writes `analysis` (reasoning_content), `commentary` with no recipient (a preamble:
    content), then the call. Its template renders one text of a tool-call message, `thinking` or
    else `content`, as an analysis message before the call, refuses both, and has no form for a
    preamble. Kept as `thinking`, the reasoning renders token for token as the model wrote it
    (`<|channel|>analysis<|message|>...<|end|><|start|>assistant`, the previous prompt's prefix
    extended), then the call in the template's header order; only the preamble is not shown again.
    Not chosen: the content alone (the reasoning lost, the preamble shown on the analysis channel),
    the preamble folded into the analysis (text the model never wrote there), or harmony's markup
    spliced into `thinking` to render the commentary message (the template's contract for that field
    is one message's text; a template that checks it more closely would refuse the chat again)."""
    if message["role"] != "assistant" or not message.get("tool_calls"):
        return message
    if not (message.get("content") and message.get("thinking")):
        return message
    return {**message, "content": ""}
