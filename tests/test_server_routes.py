"""What an OpenAI client or a probe meets beside the completions: a model retrieved by its id, an
endpoint this server does not serve named as such, no CDN-backed docs, the schema behind the key,
and log lines whose levels say what is wrong (a probe of a loading server is not an error)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient

from strata_mgpu.server import completions
from strata_mgpu.server.app import ServerState, create_app
from strata_mgpu.server.request_log import level

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture()
def http():
    return TestClient(create_app(ServerState(model_name="org/model-q4", api_key=KEY)),
                      raise_server_exceptions=False)


def test_the_openai_client_retrieves_the_model_and_an_unknown_one_is_a_404_naming_it(http):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, max_retries=0, http_client=http)
    assert client.models.retrieve("org/model-q4").id == "org/model-q4"  # an id with a slash, as HF names go
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and "'gpt-4'" in e.value.body["message"]
    assert http.get("/v1/models/org/model-q4").status_code == 401  # behind the key like the list


def test_embeddings_and_unknown_routes_say_they_are_not_served(http):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, max_retries=0, http_client=http)
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="org/model-q4", input="hi")
    assert "embeddings are not served" in e.value.body["message"]
    r = http.post("/v1/audio/speech", headers=AUTH, json={})
    assert r.status_code == 404 and r.json()["error"]["message"] == "POST /v1/audio/speech is not served by this server"


def test_no_cdn_docs_and_the_schema_only_with_the_key(http):
    for page in ("/docs", "/redoc"):
        assert http.get(page).status_code == 404
    assert http.get("/openapi.json").status_code == 401
    schema = http.get("/openapi.json", headers=AUTH).json()
    assert {"/v1/chat/completions", "/v1/models/{model_id}"} <= set(schema["paths"])
    open_server = TestClient(create_app(ServerState(model_name="m")))
    assert open_server.get("/openapi.json").status_code == 200 and open_server.get("/docs").status_code == 404


def test_probes_of_a_loading_server_are_not_errors(caplog):
    http = TestClient(create_app(ServerState(model_name="m")), raise_server_exceptions=False)
    with caplog.at_level(logging.DEBUG, logger="strata.server"):
        for _ in range(3):
            assert http.get("/health").status_code == 503
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                         ).status_code == 503
    records = [r for r in caplog.records if r.name == "strata.server"]
    probes = [r for r in records if "GET /health 503" in r.getMessage()]
    assert len(probes) == 3 and {r.levelno for r in probes} == {logging.DEBUG}
    (turned_away,) = [r for r in records if "POST /v1/chat/completions 503" in r.getMessage()]
    assert turned_away.levelno == logging.WARNING and "the model is loading" in turned_away.getMessage()
    assert not [r for r in records if r.levelno >= logging.ERROR]


def test_levels_of_the_request_line():
    assert level("/health", 503) == level("/health", 200) == logging.DEBUG
    assert level("/v1/completions", 500) == level("/v1/completions", 503) == logging.ERROR  # out of memory
    assert level("/v1/completions", 503, "model_loading") == logging.WARNING
    assert level("/v1/completions", 499) == level("/v1/completions", 400) == logging.INFO


def test_a_client_that_left_is_a_499(monkeypatch):
    monkeypatch.setattr(completions, "DISCONNECT_POLL_S", 0.01)
    aborted = []
    engine = SimpleNamespace(abort=aborted.append)

    async def gone() -> bool:
        return True

    async def whole():
        return await completions._whole(SimpleNamespace(is_disconnected=gone), engine, "chatcmpl-1", 0, "m",
                                        None, asyncio.Queue())

    r = asyncio.run(whole())
    assert r.status_code == 499 and b"client disconnected" in r.body and aborted == ["chatcmpl-1"]
