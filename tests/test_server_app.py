"""The FastAPI app in-process: loading state and failures inside the model."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.runner import load_reference_runner
from strata_mgpu.model.gguf_reader import GGUFFile
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


class FailingDecode:
    """A runner whose decode step raises, as a device fault would."""

    def __init__(self, inner):
        self.inner, self.spec = inner, inner.spec

    def new_sequence(self, max_length):
        return self.inner.new_sequence(max_length)

    def prefill(self, kv, tokens, whole_prompt=False):
        return self.inner.prefill(kv, tokens, whole_prompt)

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
