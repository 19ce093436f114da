"""The FastAPI app in-process: loading state and failures inside the model."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import DecoderRunner, load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.server.app import ServerState, create_app

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
# must reach a decode step: a sampled end-of-sequence as the first token would finish the request
# at its prompt (p ~ 0.1% on this model). The stream test failed twice in ~16 full-suite runs on
# the 2-core machine and never alone; its events are in the failure message for next time.
TO_DECODE = {**BODY, "ignore_eos": True}


def test_health_is_503_while_loading_then_200(tiny_gguf):
    state = ServerState(model_name="m")
    client = TestClient(create_app(state))
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "loading"}
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
    state.load_error = "loading failed: boom"
    assert client.get("/health").json() == {"status": "error", "error": "loading failed: boom"}
    f = GGUFFile(tiny_gguf)
    state.engine = Engine(load_reference_runner(f, spec_from_gguf(f)), tokenizer_from_gguf(f), EngineConfig())
    assert client.get("/health").status_code == 200


class FailingDecode(DecoderRunner):
    """The reference, its decode step raising as a device fault would."""

    def __init__(self, inner: DecoderRunner):
        super().__init__(inner.model)

    def decode(self, kvs, tokens):
        raise RuntimeError("device fell over")


@pytest.fixture()
def failing_client(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    runner = FailingDecode(load_reference_runner(f, spec_from_gguf(f)))
    engine = Engine(runner, tokenizer_from_gguf(f), EngineConfig())
    engine.start()
    yield TestClient(create_app(ServerState(model_name="m", engine=engine)))
    engine.shutdown()


def test_failure_during_a_stream_is_an_error_event(failing_client):
    with failing_client.stream("POST", "/v1/chat/completions", json={**TO_DECODE, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line]
    errors = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
    assert len(errors) == 1 and "device fell over" in errors[0]["message"], events
    assert events[-1] == "[DONE]", events


def test_failure_without_stream_is_500(failing_client):
    r = failing_client.post("/v1/chat/completions", json=TO_DECODE)
    assert r.status_code == 500
    assert "device fell over" in r.json()["error"]["message"] and r.json()["error"]["type"] == "server_error"


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    engine = Engine(load_reference_runner(f, spec_from_gguf(f)), tokenizer_from_gguf(f), EngineConfig(ctx_size=64))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture()
def client(engine):
    return TestClient(create_app(ServerState(model_name="m", engine=engine), max_body_bytes=4096),
                      raise_server_exceptions=False)


@pytest.mark.parametrize("key, value", [("add_generation_prompt", False), ("bos_token", "x"), ("messages", [])])
def test_chat_template_kwargs_may_not_set_the_templates_own_arguments(client, key, value):
    r = client.post("/v1/chat/completions", json={**BODY, "chat_template_kwargs": {key: value}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs" and repr(key) in error["message"]


def test_error_codes_are_strings_or_null_and_overflow_names_the_prompt_field(client):
    error = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 0}).json()["error"]
    assert error["code"] is None
    r = client.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 10})
    assert r.status_code == 400
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "prompt",
                                                   "code": "context_length_exceeded", "n_prompt_tokens": 60,
                                                   "n_ctx": 64}
    r = client.post("/v1/chat/completions", json={**BODY, "messages": [{"role": "user", "content": "x " * 60}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_tokenize_takes_content_or_prompt(client):
    by_content = client.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert by_content and client.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"] == by_content
    for body in ({}, {"content": "a", "prompt": "a"}):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 400 and "'content' or 'prompt'" in r.json()["error"]["message"], r.text


def test_a_body_over_the_cap_is_413(client):
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    r = client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "4096 bytes" in r.json()["error"]["message"]
    # no Content-Length: the chunks are counted as they arrive
    r = client.post("/v1/completions", content=iter([big[i:i + 1000] for i in range(0, len(big), 1000)]),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    small = client.post("/v1/completions", content=iter([b'{"prompt": "Hi", ', b'"max_tokens": 2}']),
                        headers={"Content-Type": "application/json"})
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] <= 2, small.text


def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(engine, monkeypatch):
    """While a prompt is being tokenized, /health still answers: the tokenizer runs off the loop."""
    encoding, health_answered = threading.Event(), threading.Event()
    encode = engine.tokenizer.encode
    loop_was_free: list[bool] = []

    def slow_encode(text, **kw):  # a 10 MB prompt takes seconds; this one waits for /health instead
        encoding.set()
        loop_was_free.append(health_answered.wait(timeout=5))
        return encode(text, **kw)

    monkeypatch.setattr(engine.tokenizer, "encode", slow_encode)
    # entered, the client runs every request on one event loop, as uvicorn does
    with TestClient(create_app(ServerState(model_name="m", engine=engine))) as client, ThreadPoolExecutor(1) as pool:
        chat = pool.submit(client.post, "/v1/chat/completions", json=BODY)
        assert encoding.wait(timeout=30)
        assert client.get("/health").status_code == 200
        health_answered.set()
        assert chat.result(timeout=60).status_code == 200
    assert loop_was_free == [True]


class OutOfMemoryOnLongPrompts(DecoderRunner):
    """The reference, its prefill running out of device memory on prompts over 30 tokens."""

    def __init__(self, inner: DecoderRunner):
        super().__init__(inner.model)

    def prefill(self, kv, tokens, whole_prompt=False, want_logits=True):
        self._fail_over_30(tokens.numel())
        return super().prefill(kv, tokens, whole_prompt)

    def prefill_many(self, kvs, chunks):
        self._fail_over_30(max(c.numel() for c in chunks))
        return super().prefill_many(kvs, chunks)

    @staticmethod
    def _fail_over_30(tokens: int) -> None:
        if tokens > 30:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has ...")


def test_out_of_memory_is_a_503_in_one_line_and_the_server_goes_on(tiny_gguf, caplog):
    f = GGUFFile(tiny_gguf)
    runner = OutOfMemoryOnLongPrompts(load_reference_runner(f, spec_from_gguf(f)))
    engine = Engine(runner, tokenizer_from_gguf(f), EngineConfig())
    engine.start()
    try:
        client = TestClient(create_app(ServerState(model_name="m", engine=engine)))
        long = {"prompt": "word " * 60, "max_tokens": 2}
        r = client.post("/v1/completions", json=long)
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        message = r.json()["error"]["message"]
        assert "ran out of memory" in message and "\n" not in message and "Tried to allocate" not in message
        assert not any(rec.exc_info for rec in caplog.records if "out of memory" in rec.getMessage())  # no traceback
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line]
        assert any('"unavailable_error"' in e for e in events) and events[-1] == "[DONE]"
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2  # the others go on
        deadline = time.monotonic() + 5  # (the answer goes out before the engine's step retires its request)
        while engine.n_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.n_running == 0  # the failed requests' KV is gone
        assert engine.pool.blocks.used_blocks == engine.prefix.stats.blocks["device"]  # its blocks too
    finally:
        engine.shutdown()
