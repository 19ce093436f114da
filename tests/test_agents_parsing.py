"""Agents' text formats on the host: the chat template with tools and tool results (against
transformers' own renderer), the Hermes tool-call parser and the reasoning splitter, whole and
streamed in every split (a fuzz). The dialects' own properties: tests/test_tool_dialects.py."""

from __future__ import annotations

import json
import random

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.tokenizer import ChatTemplate, tokenizer_from_gguf
from strata_mgpu.model.vocab import CHAT_TEMPLATE
from strata_mgpu.server import messages
from strata_mgpu.server.chat_output import ChatAnswer
from strata_mgpu.server.dialects import HERMES
from strata_mgpu.server.errors import APIError
from strata_mgpu.server.reasoning import ReasoningSplitter, opens_reasoning
from strata_mgpu.server.schemas import ChatCompletionRequest
from strata_mgpu.server.tool_calls import ToolCallParser

THINK = (HERMES.think_open, HERMES.think_close)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris and Köln?"}]},
    {"role": "assistant", "content": None, "reasoning_content": " Two cities: two calls. ",
     "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Köln"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
]

EXPECTED = """<|im_start|>system
Be brief.

# Tools

These functions are yours to call. Their signatures, one JSON object a line:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", \
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

To call functions, answer with one block a call, each a JSON object of the name and the arguments:
<tool_call>
{"name": <function name>, "arguments": <arguments as a JSON object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris and Köln?<|im_end|>
<|im_start|>assistant
<think>
Two cities: two calls.
</think>

<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Köln"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
sunny, 21 C
</tool_response>
<tool_response>
rain
</tool_response><|im_end|>
<|im_start|>assistant
"""


@pytest.fixture(scope="module")
def tok(tiny_gguf):
    return tokenizer_from_gguf(GGUFFile(tiny_gguf))


def template_messages(body: dict) -> list[dict]:
    return messages.template_messages(ChatCompletionRequest.model_validate(body).messages)


def test_a_conversation_with_tools_and_results_renders_in_qwen3s_form(tok):
    """The generated GGUF's template, fed the messages as the server passes them: the expected
    prompt, and the very text transformers' apply_chat_template renders from the same template."""
    messages = template_messages({"messages": CONVERSATION})
    ours = tok.apply_chat_template(messages, add_generation_prompt=True, tools=[WEATHER])
    assert ours == EXPECTED
    theirs = render_jinja_template([messages], tools=[WEATHER], chat_template=CHAT_TEMPLATE,
                                   add_generation_prompt=True)[0][0]
    assert ours == theirs
    thinking_off = tok.apply_chat_template(messages, add_generation_prompt=True, tools=[WEATHER], enable_thinking=False)
    assert thinking_off == EXPECTED + "<think>\n\n</think>\n\n"


def test_reasoning_of_turns_before_the_last_user_message_is_dropped(tok):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "old thought"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "thinking": "new thought"}]
    text = tok.apply_chat_template(template_messages({"messages": messages}), add_generation_prompt=False)
    assert "old thought" not in text and "<think>\nnew thought\n</think>\n\nd<|im_end|>" in text


def test_a_template_that_reads_only_string_content_gets_the_parts_joined():
    """Qwen3's own template renders `content` only when it is a string: lists are joined for it."""
    strings_only = ("{% for m in messages %}[{{ m['role'] }}:{% if m['content'] is string %}{{ m['content'] }}"
                    "{% endif %}]{% endfor %}")
    t = ChatTemplate(strings_only)
    assert not t.takes_text_parts
    parts = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]
    assert t.render(parts) == "[user:xy]"
    whole = ChatTemplate(CHAT_TEMPLATE)
    assert whole.takes_text_parts  # ours reads the parts itself: they reach it whole
    assert "user\nxy<|im_end|>" in whole.render(parts)


def test_an_assistant_refusal_part_is_text_and_empty_arguments_are_no_arguments():
    """An assistant message's `refusal` content parts (OpenAI's, sent back in a history) are its
    text; a call's arguments "" (some clients' "no arguments") read as {}; a refusal part on a
    user message is still a 400 naming it."""
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."},
                                                {"type": "text", "text": " Sorry."}]}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}}]}
    out = template_messages({"messages": [{"role": "user", "content": "hi"}, refused, call,
                                          {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]})
    assert out[1]["content"] == "I can't. Sorry." and out[2]["tool_calls"][0]["function"]["arguments"] == {}
    with pytest.raises(APIError, match=r"messages\[0\]\.content\[0\]\.type"):
        template_messages({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]})


# -- the tool-call parser ----------------------------------------------------------------------------

ANSWER = ('Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "when": '
          '{"days": [1, 2, {"deep": "x}y"}]}, "note": "a \\"quoted\\" </tool_call> inside"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "lookup", "arguments": "{\\"q\\": \\"日本語 ✓\\"}"}\n</tool_call>\n'
          'Then <tool_call>{not json}</tool_call> and <tool_call>{"name": 3}</tool_call> done.  ')


def parse(chunks: list[str], max_calls: int | None = None, cut: bool = False
          ) -> tuple[str, list[tuple[str, str]], list[list[str]]]:
    """(content, calls, each call's argument deltas) of an answer fed in `chunks`."""
    p = ToolCallParser(HERMES, max_calls=max_calls)
    content, calls, deltas = "", [], []
    for c in [*chunks, None]:
        out = p.feed(c) if c is not None else p.finish(cut)
        content += out.content
        calls += out.calls
        deltas += out.deltas
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == len(calls)
    heads = [d for d in deltas if d.id is not None]
    # the calls' heads, and that of a call the limit cut (no call)
    assert [(d.index, d.id, d.name) for d in heads][:len(calls)] == [(c.index, c.id, c.name) for c in calls]
    assert len(heads) == len(calls) + p.cut_call
    pieces = [[d.arguments for d in deltas if d.index == c.index and d.id is None] for c in calls]
    assert all("".join(p) == c.arguments and all(p) for p, c in zip(pieces, calls, strict=True))
    return content, [(c.name, c.arguments) for c in calls], pieces


def test_calls_are_parsed_out_and_the_rest_is_content():
    content, calls, _ = parse([ANSWER])
    # the string inside the first call's arguments that looks like a closing tag ends its block
    # early: the call was sure (its name read), so it keeps its text as written, unterminated (no
    # JSON: nothing invents its end), and the text after that tag is content; the JSON-string
    # call parses whole; the malformed blocks are content
    assert calls == [("get_weather", '{"city": "Zürich", "when": {"days": [1, 2, {"deep": "x}y"}]}, '
                                     '"note": "a \\"quoted\\" '), ("lookup", '{"q": "日本語 ✓"}')]
    assert content == ('Let me look that up.\n\ninside"}}\n</tool_call>\nThen <tool_call>{not json}</tool_call> and '
                       '<tool_call>{"name": 3}</tool_call> done.')


def test_nested_json_and_unicode_arguments_keep_the_models_text():
    text = ('<tool_call>\n{"name": "f", "arguments": {"a": {"b": [1, 2.5e3, {"c": null}]}, "s": "é\\u00e9 🙂 \\n"}}'
            '\n</tool_call>')
    content, calls, _ = parse([text])
    assert content == ""
    (name, arguments), = calls
    assert name == "f" and arguments == '{"a": {"b": [1, 2.5e3, {"c": null}]}, "s": "é\\u00e9 🙂 \\n"}'
    assert json.loads(arguments) == {"a": {"b": [1, 2500.0, {"c": None}]}, "s": "éé 🙂 \n"}


@pytest.mark.parametrize("text", [ANSWER, ANSWER.replace("</tool_call> inside", "inside"),
                                  'hi <tool_call>\n{"name": "x", "arguments": {"a": 1}', "plain text, no call  \n",
                                  "<tool_call", "a <tool_cal b <tool_call>", "\n\n<tool_call>\n{}\n</tool_call>\n\n"])
def test_every_split_of_the_stream_parses_as_the_whole(text):
    whole = parse([text])
    for i in range(len(text) + 1):
        content, calls, pieces = parse([text[:i], text[i:]])
        assert (content, calls) == whole[:2], i
    rng = random.Random(0)
    for _ in range(200):  # and random splits into many pieces
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert parse(chunks)[:2] == whole[:2], chunks
    one_char = parse(list(text))
    assert one_char[:2] == whole[:2]
    for call_pieces, (_, arguments) in zip(one_char[2], one_char[1], strict=True):
        if arguments in text:  # an object as the model wrote it: it streams as it arrives, in many pieces
            assert len(call_pieces) > len(arguments) // 3


def test_an_unterminated_call_keeps_its_text_or_is_cut_out_or_is_content():
    """A call whose name was read was streamed already: where the model ends the answer inside its
    arguments, they are its text as written (no JSON, nothing invented); where the length limit
    cuts them, it is no call. A block that had not got so far is content where the model ended
    it, nothing where the limit cut it (no markup leaks into content)."""
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert parse([text])[:2] == ("Sure.", [("get_weather", '{"city": "Pa')])
    assert parse([text], cut=True)[:2] == ("Sure.", [])
    early = 'Sure.\n<tool_call>\n{"name": "get_wea'
    assert parse([early])[:2] == (early, [])
    assert parse([early], cut=True)[:2] == ("Sure.", [])
    assert parse(["Sure. <tool_ca"], cut=True)[:2] == ("Sure.", [])  # a tag's start held back: dropped


def test_a_plain_answer_is_kept_exactly():
    text = "  Nothing to call here.\n\n"
    assert parse([text])[0] == text


def test_at_most_one_call_without_parallel_calls():
    content, calls, _ = parse([ANSWER.replace("</tool_call> inside", "inside")], max_calls=1)
    assert [name for name, _ in calls] == ["get_weather"] and content == "Let me look that up."


# -- reasoning -----------------------------------------------------------------------------------------

def split(chunks: list[str], opened: bool = False) -> tuple[str, str]:
    s = ReasoningSplitter(THINK, opened)
    reasoning, content = "", ""
    for c in chunks:
        r, t = s.feed(c)
        reasoning, content = reasoning + r, content + t
    r, t = s.finish()
    return reasoning + r, content + t


@pytest.mark.parametrize("text, opened, expected", [
    ("<think>\nLet me think.\nStill.\n</think>\n\nThe answer.", False, ("Let me think.\nStill.", "The answer.")),
    ("\n <think>x</think>y", False, ("x", "y")),
    ("No thinking here. <think>inline</think>", False, ("", "No thinking here. <think>inline</think>")),
    ("  plain  ", False, ("", "  plain  ")),
    ("<think>\ncut off mid thou", False, ("cut off mid thou", "")),
    ("already thinking\n</think>\n\nanswer", True, ("already thinking", "answer")),
    ("<thin", False, ("", "<thin")),
    ("<think></think>", False, ("", "")),
])
def test_reasoning_is_split_in_every_split_of_the_stream(text, opened, expected):
    assert split([text], opened) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert split([text[:i], text[i:j], text[j:]], opened) == expected, (i, j)


def test_whether_a_prompt_opened_a_reasoning_block():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not opens_reasoning("<|im_start|>assistant\n", THINK)


def test_a_chat_answer_splits_reasoning_then_calls():
    text = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    whole = ChatAnswer(HERMES, split_reasoning=True, opened=False, parse_tools=True)
    whole.feed(text)
    whole.finish()
    message = whole.message()
    assert message["reasoning_content"] == "The user wants weather." and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    raw = ChatAnswer(HERMES, split_reasoning=False, opened=False, parse_tools=False)  # reasoning-format none, no tools
    raw.feed(text)
    raw.finish()
    assert raw.message() == {"role": "assistant", "content": text}
