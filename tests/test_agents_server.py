"""The API of agents in-process, through the official openai client: a scripted model (it says
what a test needs: a reasoning block, tool calls, a malformed call) behind the real app and
engine; reasoning split whole and streamed, tool calls whole and streamed, parallel_tool_calls,
tool_choice none, --reasoning-format none; the strict inputs' 400s and the log line of every
request."""

from __future__ import annotations

import json
import logging

import openai
import pytest

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
