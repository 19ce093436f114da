"""End to end: a real uvicorn server in a subprocess, driven by the official openai client."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
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
