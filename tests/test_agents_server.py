"""The API of agents in-process, through the official openai client: a scripted model (it says
what a test needs: a reasoning block, tool calls, a malformed call) behind the real app and
engine; reasoning split whole and streamed, tool calls whole and streamed, parallel_tool_calls,
tool_choice none, --reasoning-format none; the strict inputs' 400s and the log line of every
request; a client's schema or a model's text never a 500, and a failed handler leaves no request
running."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import openai
import pytest

from strata_mgpu.engine.engine import Engine
from strata_mgpu.model.tokenizer import ChatTemplate
from strata_mgpu.server import completions
from strata_mgpu.server.app import ServerState, create_app
from strata_mgpu.server.completions import ChatOptions, prepare_chat
from strata_mgpu.server.dialects import HERMES
from strata_mgpu.server.grammars import Grammars
from strata_mgpu.server.schemas import ChatCompletionRequest
from strata_mgpu.server.tool_calls import ToolCallParser
from tests.scripted import client_for, http_client, prompt_text, say, scripted_engine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted(tiny_gguf):
    with scripted_engine(tiny_gguf) as engine_and_runner:
        yield engine_and_runner


REASONED = "<think>\nThe user wants 2 + 2.\n</think>\n\nIt is 4."
CALLS = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "when": ["today"]}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>')


def streamed(client: openai.OpenAI, **kw) -> tuple[str, str, list, list]:
    """(content, reasoning, finish reasons, chunks) of a stream."""
    chunks = list(client.chat.completions.create(model="m", stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    return content, reasoning, [c.choices[0].finish_reason for c in chunks if c.choices and
                                c.choices[0].finish_reason], chunks


def test_reasoning_is_split_whole_and_streamed(scripted):
    engine, runner = scripted
    say(engine, runner, REASONED)
    client = client_for(engine)
    r = client.chat.completions.create(model="m", messages=USER, temperature=0)
    message = r.choices[0].message
    assert message.content == "It is 4." and message.model_extra["reasoning_content"] == "The user wants 2 + 2."
    content, reasoning, finishes, chunks = streamed(client, messages=USER, temperature=0)
    assert (content, reasoning, finishes) == ("It is 4.", "The user wants 2 + 2.", ["stop"])
    assert sum(1 for c in chunks if c.choices and (c.choices[0].delta.model_extra or {}).get("reasoning_content")) > 1
    raw = client_for(engine, reasoning_format="none").chat.completions.create(model="m", messages=USER, temperature=0)
    assert raw.choices[0].message.content == REASONED and "reasoning_content" not in raw.choices[0].message.model_extra


def test_a_tool_call_round_trip_whole_and_streamed(scripted):
    engine, runner = scripted
    say(engine, runner, CALLS)
    client = client_for(engine)
    r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "when": ["today"]}),
        ("function", "get_weather", {"city": "Köln"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id

    with client.chat.completions.stream(model="m", messages=USER, tools=[WEATHER], temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 2  # the arguments came in pieces
    streamed_calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed_calls] == [
        (c.function.name, c.function.arguments) for c in calls]

    say(engine, runner, "Sunny in Paris, rain in Köln.")
    follow = [*USER, choice.message.model_dump(exclude_none=True),
              *({"role": "tool", "tool_call_id": c.id, "content": f"result {i}"} for i, c in enumerate(calls))]
    r = client.chat.completions.create(model="m", messages=follow, tools=[WEATHER], temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Sunny in Paris, rain in Köln."
    prompt = prompt_text(engine, runner)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "when": ["today"]}}\n</tool_call>'
            in prompt)
    assert "<|im_start|>user\n<tool_response>\nresult 0\n</tool_response>\n<tool_response>\nresult 1\n" \
           "</tool_response><|im_end|>" in prompt
    assert '"name": "get_weather"' in prompt.split("<tools>")[1].split("</tools>")[0]


def test_without_parallel_calls_the_answer_stops_at_its_first_call(scripted):
    engine, runner = scripted
    say(engine, runner, CALLS + "\n" + "and more text " * 40)
    client = client_for(engine)
    r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], parallel_tool_calls=False,
                                       temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    assert r.usage.completion_tokens < len(runner.script) // 2  # the generation was stopped there
    _, _, finishes, chunks = streamed(client, messages=USER, tools=[WEATHER], parallel_tool_calls=False,
                                      temperature=0)
    heads = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or []) if t.id]
    assert finishes == ["tool_calls"] and len(heads) == 1


def test_a_malformed_or_unterminated_call_is_content(scripted):
    engine, runner = scripted
    client = client_for(engine)
    for text in ('Hm <tool_call>\n{"name": get_weather}\n</tool_call> ok', 'Cut <tool_call>\n{"name": "get_wea'):
        say(engine, runner, text)
        r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], temperature=0)
        assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
        content, _, finishes, _ = streamed(client, messages=USER, tools=[WEATHER], temperature=0)
        assert content == text and finishes == ["stop"]


def test_a_broken_call_keeps_its_text_and_whole_and_streamed_agree(scripted):
    """A call whose head was read but whose JSON then broke (Python's False) is that call with
    its arguments as the model wrote them (no JSON: the client's parse fails), never a valid call
    with keys dropped; a raw newline inside a string is read and escaped. Whole and streamed agree."""
    engine, runner = scripted
    client = client_for(engine)
    for arguments, expected in (('{"city": "Paris", "exact": False}', '{"city": "Paris", "exact": False}'),
                                ('{"city": "Paris\nFrance"}', '{"city": "Paris\\nFrance"}')):
        say(engine, runner, f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>')
        r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.arguments == expected
        _, _, finishes, chunks = streamed(client, messages=USER, tools=[WEATHER], temperature=0)
        assert finishes == ["tool_calls"] and streamed_calls(chunks) == [("get_weather", expected)]


def test_tool_choice_none_offers_no_tools_and_cannot_call(scripted):
    engine, runner = scripted
    say(engine, runner, CALLS)  # the model would call at once
    client = client_for(engine)
    r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=12)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" not in r.choices[0].message.content
    assert "<tools>" not in prompt_text(engine, runner)


def test_chat_logprobs_stream_with_their_tokens(scripted):
    engine, runner = scripted
    say(engine, runner, "One two three.")
    client = client_for(engine)
    whole = client.chat.completions.create(model="m", messages=USER, temperature=0, logprobs=True, top_logprobs=2)
    entries = whole.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == "One two three."
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)
    assert all(bytes(e.bytes).decode() == e.token and e.top_logprobs[0].token == e.token for e in entries)
    chunks = list(client.chat.completions.create(model="m", messages=USER, temperature=0, logprobs=True,
                                                 top_logprobs=2, stream=True))
    streamed_entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed_entries] == [(e.token, e.logprob) for e in entries]


# -- strict inputs -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(scripted):
    return http_client(scripted[0])


CHAT = {"messages": USER, "max_tokens": 2}


@pytest.mark.parametrize("path, body, param, needle", [
    ("chat", {"tools": "notalist"}, "tools", "valid list"),
    ("chat", {"tool_choice": 17}, "tool_choice", "'none', 'auto', 'required'"),
    ("chat", {"tool_choice": "sometimes"}, "tool_choice", "'none', 'auto', 'required'"),
    ("chat", {"tool_choice": {"type": "function", "function": {}}}, "tool_choice", "function.name"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "no tool is named 'nope'"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools", "own name"),
    ("chat", {"logprobs": "maybe"}, "logprobs", "valid boolean"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("chat", {"response_format": {"type": "nonsense"}}, "response_format.type", "'json_schema'"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "needs its 'json_schema'"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "cannot be followed"),
    ("chat", {"n": 2}, "n", "only n = 1"),
    ("chat", {"functions": [{"name": "f"}]}, "functions", "send 'tools'"),
    ("chat", {"function_call": "auto"}, "function_call", "send 'tools'"),
    ("chat", {"audio": {"voice": "x"}}, "audio", "not supported"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities", "text only"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "enable_thinking"),
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("chat", {"logit_bias": {"5": 300}}, "logit_bias", "-100..100"),
    ("chat", {"logit_bias": {"99999999": 1}}, "logit_bias", "token ids are in"),
    ("chat", {"temperature": "hot"}, "temperature", "valid number"),
    ("chat", {"stop": 5}, "stop", "a string or a list of strings"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "this model takes text only"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool_call_id"),
    ("chat", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools'"),
    ("text", {"prompt": ["one", "two"]}, "prompt", "a list of prompts is not supported; send one prompt a request"),
    ("text", {"prompt": 5}, "prompt", "a string or a list of token ids"),
    ("text", {"echo": True}, "echo", "not supported"),
    ("text", {"best_of": 2}, "best_of", "best_of = 1"),
    ("text", {"suffix": "end"}, "suffix", "not supported"),
    ("text", {"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("text", {"logprobs": True}, "logprobs", "valid integer"),
])
def test_known_fields_of_a_wrong_type_or_value_and_unbuilt_options_are_400s_naming_them(http, caplog, path, body,
                                                                                         param, needle):
    url, base = ("/v1/chat/completions", CHAT) if path == "chat" else ("/v1/completions", {"prompt": "x",
                                                                                           "max_tokens": 2})
    with caplog.at_level(logging.INFO, logger="strata.server"):
        r = http.post(url, json={**base, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert "Input should be a valid string" not in error["message"]  # pydantic's words about a union's member
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "strata.server"]
    assert any(f"POST {url} 400 req-" in m and needle in m for m in lines), lines


def test_every_request_leaves_a_log_line_and_unknown_fields_are_logged_once(http, scripted, caplog):
    say(*scripted, "Hi.")
    with caplog.at_level(logging.INFO, logger="strata.server"):
        for _ in range(2):
            r = http.post("/v1/chat/completions", json={**CHAT, "frobnicate": 1, "user": "u"})
            assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"})
        assert r.status_code == 400
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "strata.server"]
    ok = [m for m in lines if "POST /v1/chat/completions 200 chatcmpl-" in m]
    assert len(ok) == 2 and len({m.split()[-1] for m in ok}) == 2
    assert sum("'frobnicate'" in m for m in lines) == 1
    assert any("POST /v1/chat/completions 400 req-" in m and "invalid JSON" in m for m in lines)


# -- cut short, the dialects, thinking off -----------------------------------------------------------------

def streamed_calls(chunks) -> list[tuple[str, str]]:
    """(name, arguments) of each call a stream's deltas build."""
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(t.index, ["", ""])
            entry[0] += t.function.name or ""
            entry[1] += t.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def tokens_until(engine: Engine, text: str, marker: str) -> int:
    """How many of the text's tokens the model says before `marker` is complete."""
    tok = engine.tokenizer
    ids = tok.encode(text, add_special=False)
    return next(k for k in range(len(ids) + 1) if marker in tok.decode(ids[:k], skip_special=False))


ANSWER_OF_TWO = '<think>\nWeather.\n</think>\n\nChecking.\n' + CALLS.removeprefix("Checking.\n")


@pytest.mark.parametrize("marker, finish, calls, cut", [
    ('{"na', "length", [], None),  # cut before the call's name: the block is dropped
    # in the first call's arguments: whole, no call is left (length); streamed, its head and
    # arguments so far, unterminated, and length
    ('"Paris", "wh', "length", [], '{"city": "Paris"'),
    # in the second's: whole, the first call (tool_calls); streamed, length (the last call is cut)
    ('"Köln"', "tool_calls", [("get_weather", {"city": "Paris", "when": ["today"]})], '{"city": "Köln"'),
    ('"Köln"}}\n</tool_call>', "tool_calls", [("get_weather", {"city": "Paris", "when": ["today"]}),
                                               ("get_weather", {"city": "Köln"})], None),
])
def test_a_call_cut_by_the_length_limit_leaks_no_markup_whole_and_streamed(scripted, marker, finish, calls, cut):
    """At the limit: the reasoning kept, no call markup in the content, a call cut in its
    arguments left out of a whole response (`tool_calls` where a whole call remains, else
    `length`); a stream that gave out its head sends nothing to close it and ends with `length`."""
    engine, runner = scripted
    say(engine, runner, ANSWER_OF_TWO + "\nand then some more words")
    max_tokens = tokens_until(engine, ANSWER_OF_TWO, marker)
    client = client_for(engine)
    r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], temperature=0, max_tokens=max_tokens)
    choice = r.choices[0]
    assert choice.finish_reason == finish and choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "Weather."
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert [(n, json.loads(a)) for n, a in got] == calls
    content, reasoning, finishes, chunks = streamed(client, messages=USER, tools=[WEATHER], temperature=0,
                                                    max_tokens=max_tokens)
    assert (content, reasoning) == ("Checking.", "Weather.")
    if cut is None:
        assert finishes == [finish] and streamed_calls(chunks) == got
    else:
        assert finishes == ["length"] and streamed_calls(chunks) == [*got, ("get_weather", cut)]

def test_a_json_answer_cut_by_the_limit_ends_with_length(scripted):
    engine, runner = scripted
    say(engine, runner, '{"city": "Paris", "days": 3}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    kw = dict(messages=USER, temperature=0, max_tokens=4, extra_body={"chat_template_kwargs": NO_THINK},
              response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    client = client_for(engine)
    r = client.chat.completions.create(model="m", **kw)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and '{"city": "Paris"'.startswith(text) and len(text) > 2
    assert streamed(client, **kw)[::2] == (text, ["length"])


XML_CALL = ("Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
TYPED_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}


def test_the_qwen3_coder_dialect_through_the_server_whole_and_streamed(scripted):
    engine, runner = scripted
    say(engine, runner, XML_CALL)
    client = client_for(engine, tool_call_parser="qwen3_coder")
    r = client.chat.completions.create(model="m", messages=USER, tools=[TYPED_WEATHER], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me see."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "San Francisco", "days": 3}
    content, _, finishes, chunks = streamed(client, messages=USER, tools=[TYPED_WEATHER], temperature=0)
    assert (content, finishes) == ("Let me see.", ["tool_calls"])
    assert streamed_calls(chunks) == [("get_weather", call.function.arguments)]
    # the hermes dialect (the tiny model's template) reads the same text as content
    r = client_for(engine).chat.completions.create(model="m", messages=USER, tools=[TYPED_WEATHER], temperature=0)
    assert r.choices[0].message.content == XML_CALL and r.choices[0].message.tool_calls is None


NO_THINK = {"enable_thinking": False}
REQUIRED = {"tools": [WEATHER], "tool_choice": "required"}
PATHS = {"required": REQUIRED,
         "named": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         "response_format": {"response_format": {"type": "json_object"}},
         "auto": {"tools": [WEATHER]}}


@pytest.mark.parametrize("path", PATHS)
def test_enable_thinking_false_is_honoured_on_every_path(scripted, path):
    """Thinking off: the prompt closes the reasoning block and no grammar lets one open; on (the
    template's default): a grammar lets the model open one before its answer."""
    engine, _ = scripted
    tok = engine.tokenizer
    grammars, options = Grammars(), ChatOptions(HERMES)
    think = tok.tokens.index("<think>")
    for kwargs in (NO_THINK, {}):
        body = ChatCompletionRequest.model_validate({"messages": USER, "chat_template_kwargs": kwargs,
                                                     **PATHS[path]})
        prepared = prepare_chat(engine, grammars, body, options)
        prompt = tok.decode(prepared.prompt, skip_special=False)
        assert prompt.endswith("<think>\n\n</think>\n\n") is (kwargs == NO_THINK)
        if path == "auto":
            assert prepared.grammar is None
        else:
            assert prepared.grammar.matcher().accept(think) is (kwargs != NO_THINK), kwargs


def test_qwen3_coders_own_template_chooses_its_dialect_and_a_required_call_follows_it(scripted, monkeypatch):
    """The tiny model given Qwen3-Coder's published template: `auto` picks the XML dialect, the
    tools reach the prompt in its form, and a required call is held to its grammar and read back."""
    engine, runner = scripted
    source = (Path(__file__).parent / "data" / "templates" / "qwen3-coder.jinja").read_text()
    monkeypatch.setattr(engine.tokenizer, "chat_template", ChatTemplate(source))
    assert ServerState(model_name="m", engine=engine).chat_options(engine).dialect.name == "qwen3_coder"
    call = XML_CALL.removeprefix("Let me see.\n")
    say(engine, runner, call)
    client = client_for(engine)  # tool_call_parser auto
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model="m", messages=USER, tools=[TYPED_WEATHER], tool_choice=choice,
                                           temperature=0, max_tokens=80)
        assert r.choices[0].finish_reason == "tool_calls", (choice, r.choices[0])
        (got,) = r.choices[0].message.tool_calls
        assert json.loads(got.function.arguments) == {"city": "San Francisco", "days": 3}
    prompt = engine.tokenizer.decode(runner.prompts[-1], skip_special=False)
    assert "<function>\n<name>get_weather</name>" in prompt and "<parameter=example_parameter_1>" in prompt


def test_a_forced_call_cannot_invent_keys_unless_the_server_reads_schemas_leniently(scripted):
    """The model would add a key WEATHER's schema does not list (it states no additionalProperties,
    as LangChain's do): strict, the grammar closes the arguments after the declared key; with
    --lenient-json-schema the key goes through."""
    engine, runner = scripted
    say(engine, runner, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "wind": 3}}\n</tool_call>')
    kw = dict(model="m", messages=USER, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=60, extra_body={"chat_template_kwargs": NO_THINK})
    for lenient, expected in ((False, {"city": "Paris"}), (True, {"city": "Paris", "wind": 3})):
        r = client_for(engine, lenient_json_schema=lenient).chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == expected


# -- no 500 from a model's text or a client's schema; no request left running --------------------------------

def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("parser, body, message", [
    ("qwen3_coder", {"tools": [tool({"type": "object", "properties": {"x": {"enum": None}}})]},
     "properties.x.enum: expected a list"),
    ("qwen3_coder", {"tools": [tool({"type": "object", "properties": ["x"]})]}, "properties: expected an object"),
    ("qwen3_coder", {"tools": [tool({"type": "object", "properties": {"x": {}}, "required": 5})]},
     "required: expected a list"),
    ("qwen3_coder", {"tools": [tool({"type": "object", "properties": {"x": {"type": "string", "maxLength": "3"}}})]},
     "maxLength: expected a non-negative integer"),
    ("hermes", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "x-guidance": "lenient"}}}}, "x-guidance: expected an object"),
])
def test_a_schema_the_grammar_cannot_read_is_a_400_naming_it(scripted, parser, body, message):
    engine, _ = scripted
    http = http_client(engine, tool_call_parser=parser)
    if "tools" in body:
        body = {**body, "tool_choice": "required"}
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": USER, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == ("tools" if "tools" in body else "response_format")
    assert message in error["message"], error


def test_a_model_call_of_a_malformed_schema_or_with_a_bad_name_is_read_without_a_500(scripted):
    """Under tool_choice auto the malformed schema is only read (the call's value stays text); a
    name with a bad escape makes its block content, whole and streamed (the stream ends with
    [DONE])."""
    engine, runner = scripted
    say(engine, runner, "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>")
    bad = tool({"type": "object", "properties": {"x": {"enum": None}}, "required": 5})
    r = client_for(engine, tool_call_parser="qwen3_coder").chat.completions.create(
        model="m", messages=USER, tools=[bad], temperature=0)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"x": "1"}
    text = '<tool_call>\n{"name": "get_w\\qeather", "arguments": {"city": "x"}}\n</tool_call>'
    say(engine, runner, text)
    client = client_for(engine)
    r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    content, _, finishes, _ = streamed(client, messages=USER, tools=[WEATHER], temperature=0)
    assert content == text and finishes == ["stop"]


def test_a_failure_reading_the_answer_gives_its_text_as_content_and_is_logged(scripted, monkeypatch, caplog):
    engine, runner = scripted
    say(engine, runner, CALLS)

    def broken(self, delta):
        raise RuntimeError("a reader's bug")
    monkeypatch.setattr(ToolCallParser, "feed", broken)
    client = client_for(engine)
    with caplog.at_level(logging.ERROR, logger="strata.server"):
        r = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER], temperature=0)
        content, _, finishes, _ = streamed(client, messages=USER, tools=[WEATHER], temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == CALLS
    assert (content, finishes) == (CALLS, ["stop"])
    assert sum("reading the answer failed" in rec.getMessage() for rec in caplog.records) == 2  # once a request


def test_a_whole_response_whose_handler_fails_leaves_no_request_running(scripted, monkeypatch):
    """The handler fails while the request decodes: the request is aborted at once, not left to
    run to max_tokens (the event loop stays up, as a server's does, so nothing else ends it)."""
    engine, runner = scripted
    say(engine, runner, "word " * 1500)

    def broken(self, out):
        raise RuntimeError("a handler's bug")
    monkeypatch.setattr(completions._ChatView, "choices", broken)
    decode = runner.decode

    def slow(kvs, tokens):  # 1500 tokens take 7.5 s: only an abort ends the request within the deadline
        time.sleep(0.005)
        return decode(kvs, tokens)
    monkeypatch.setattr(runner, "decode", slow)

    async def run() -> tuple[int, int]:
        app = create_app(ServerState(model_name="m", engine=engine))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 1500})
            deadline = time.monotonic() + 2
            while engine.n_running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return r.status_code, engine.n_running
    assert asyncio.run(run()) == (500, 0)
