"""End to end: a real uvicorn server in a subprocess, driven by the official openai client."""

from __future__ import annotations

import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.server_proc import running_server

API_KEY = "test-key"
MODEL = "tiny-test"


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [str(tiny_gguf), "--api-key", API_KEY, "--alias", MODEL, "--ctx-size", "512", "--chunk-size", "16",
            "--devices", "cpu"]
    with running_server(args, log) as base:
        yield base, log


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_chat_completion(client):
    r = chat(client, "Hello!", max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    assert timings["prompt_n"] == r.usage.prompt_tokens and timings["prompt_per_second"] > 0
    assert timings["queue_ms"] >= 0  # submitted -> first prompt chunk: the wait prompt_ms leaves out


def test_text_completion(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].text, str)


def test_streaming_equals_whole_and_carries_usage(client):
    whole = chat(client, "Stream me", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(chat(client, "Stream me", max_tokens=10, temperature=0, stream=True,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_raw_sse_format(server):
    base, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_max_tokens_and_stop(client):
    base = chat(client, "Count", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].message.content
    assert base.usage.completion_tokens == 12
    stop = text[4:7]
    r = chat(client, "Count", max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]


def test_seed_determinism(client):
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.95, extra_body={"ignore_eos": True})
    a = chat(client, "Surprise me", seed=42, **kw).choices[0].message.content
    b = chat(client, "Surprise me", seed=42, **kw).choices[0].message.content
    c = chat(client, "Surprise me", seed=43, **kw).choices[0].message.content
    assert a == b != c


def test_eight_concurrent_streams_are_each_correct(client):
    prompts = [f"Request number {i}: tell me about {w}" for i, w in enumerate("abcdefgh")]
    kw = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    expected = [chat(client, p, **kw).choices[0].message.content for p in prompts]

    def stream(p: str) -> str:
        return "".join(c.choices[0].delta.content or "" for c in chat(client, p, stream=True, **kw) if c.choices)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(stream, prompts))
    assert got == expected


def test_stream_closed_midway_is_freed(server, client):
    base, _ = server
    aborted = metric(base, 'strata_requests_total{finish_reason="abort"}')
    stream = chat(client, "Go on forever", max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while metric(base, 'strata_requests_total{finish_reason="abort"}') <= aborted:
        assert time.monotonic() < deadline, "the closed stream was not aborted"
        time.sleep(0.1)
    assert metric(base, "strata_requests_running") == 0
    r = chat(client, "Still there?", max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_models_health_tokenize_metrics(server, client):
    base, log = server
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    h = {"Authorization": f"Bearer {API_KEY}"}
    toks = httpx.post(base + "/tokenize", json={"content": "Hello world"}, headers=h).json()["tokens"]
    assert httpx.post(base + "/detokenize", json={"tokens": toks}, headers=h).json()["content"] == "Hello world"
    assert metric(base, "strata_prompt_tokens_total") > 0
    assert metric(base, "strata_generated_tokens_total") > 0
    assert re.search(r"prompt \d+ tok .* tok/s\), decode \d+ tok .* tok/s\)", log.read_text())


@pytest.mark.parametrize("kw, status, needle", [
    (dict(temperature=5), 400, "temperature"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(n=2), 400, "n"),
    (dict(max_tokens=100_000), 400, "context"),
])
def test_bad_requests_are_400(client, kw, status, needle):
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, "x", **kw)
    assert e.value.status_code == status
    assert needle in e.value.body["message"]


def test_context_overflow_reports_sizes(server):
    base, _ = server
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": [5] * 500, "max_tokens": 50})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["n_prompt_tokens"] == 500 and err["n_ctx"] == 512 and err["type"] == "invalid_request_error"


def test_a_body_over_the_cap_is_413_over_the_socket(server):
    base, _ = server
    prompt = "x" * (2 << 20)  # 2 MiB: over the 1 MiB that a 512-token context allows
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert httpx.get(base + "/health").status_code == 200


def test_invalid_json_unknown_model_and_auth(server, client):
    base, _ = server
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(base + "/v1/chat/completions", content=b'{"messages": [', headers=h)
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": "nope"}, headers=h)
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/health").status_code == 200  # health needs no key


# -- agents: tools, structured outputs, logprobs on the random demo model ------------------------------

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # a random model could think to max_tokens


@pytest.fixture(scope="module")
def agents(tiny_gguf, tmp_path_factory):
    """A server with room for tool definitions in the prompt (the tiny vocabulary spells them long)."""
    log = tmp_path_factory.mktemp("agents") / "server.log"
    args = [str(tiny_gguf), "--api-key", API_KEY, "--alias", MODEL, "--ctx-size", "4096", "--chunk-size", "256",
            "--devices", "cpu"]
    with running_server(args, log) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_a_required_tool_call_round_trip(agents):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = agents.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=120, extra_body=NO_THINKING)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    follow = [*messages, choice.message.model_dump(exclude_none=True),
              *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in choice.message.tool_calls)]
    r2 = agents.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, temperature=0, max_tokens=8,
                                        extra_body={"ignore_eos": True})
    assert r2.choices[0].finish_reason in ("length", "tool_calls", "stop")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens  # the call and its result


def test_a_named_tool_call_streams_and_reassembles(agents):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Time in Berlin?"}], tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
              temperature=0.8, seed=11, max_tokens=120, extra_body=NO_THINKING)
    with agents.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)
    assert [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    whole = agents.chat.completions.create(**kw)
    assert whole.choices[0].message.tool_calls[0].function.arguments == call.function.arguments  # seeded: the same


def test_json_schema_and_json_object_answers_are_valid_json(agents):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                        "maxItems": 3}},
              "required": ["name", "age", "pets"], "additionalProperties": False}
    for seed in (0, 1):
        person = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
        r = chat(agents, "Describe a person as JSON.", temperature=1.0, seed=seed, max_tokens=150,
                 extra_body=NO_THINKING, response_format=person)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = chat(agents, "Any JSON object.", temperature=0, max_tokens=150, extra_body=NO_THINKING,
             response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # a free object may run to max_tokens: the documented exception
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_logprobs_over_the_wire(agents):
    """Both shapes from a served model (its CPU stage computes experts with ggml's quantized dots, so
    its logits are not the fp32 oracle's: the log-softmax itself is checked against the oracle's
    logits within 1e-5 in-process, tests/test_agents_engine.py). Greedy: each token is its top
    alternative; alternatives sorted; offsets run over the text."""
    r = agents.completions.create(model=MODEL, prompt=[1100, 700, 42, 9, 301, 77], max_tokens=6, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for text, got, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(got, abs=1e-6) and top[text] == got
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6 and got < 0
    c = chat(agents, "Top logprobs", max_tokens=4, temperature=0.7, seed=3, logprobs=True, top_logprobs=5,
             extra_body={"ignore_eos": True})
    entries = c.choices[0].logprobs.content
    assert len(entries) == 4 and "".join(e.token for e in entries) == c.choices[0].message.content
    for entry in entries:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-6
        assert bytes(entry.bytes) == entry.token.encode() or "\ufffd" in entry.token


def test_the_openai_client_reads_the_cached_tokens_whole_and_streamed(client, server):
    """A conversation's second turn through the official client: its usage says how much of the
    prompt came from the prefix cache, in the whole response and in a stream's usage chunk; a bad
    `max_tokens` still gets a 400 naming it."""
    system = {"role": "system", "content": "You answer in short sentences about rivers and mills. " * 6}
    first = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "one"}],
                                           max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "two"}],
                                            max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    stream = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "three"}],
                                            max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= 64
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, "x", max_tokens="many")
