"""A model that says what a test needs (a reasoning block, tool calls in a template's markup, a
malformed call) behind the real engine and app: `ScriptedRunner`, `scripted_engine`, `say`, and
the official openai client on the app in-process (`client_for`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import torch
from fastapi.testclient import TestClient

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import DecoderRunner, load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.server.app import ServerState, create_app


class ScriptedRunner(DecoderRunner):
    """Each prompt is answered with the next of `scripts` (token ids; the last one again once they
    run out), greedily: the logits put the mass on its next token. No forward runs (the KV stays
    empty: the prefix cache is off here); each prompt is kept."""

    def __init__(self, inner: DecoderRunner):
        super().__init__(inner.model)
        self.scripts: list[list[int]] = [[0]]
        self.prompts: list[list[int]] = []
        self._answered = 0  # prompts answered since the scripts were set
        self._said: dict[int, tuple[list[int], int]] = {}  # id(kv) -> (its script, tokens of it given)

    @property
    def script(self) -> list[int]:
        return self.scripts[-1]

    def set_scripts(self, scripts: list[list[int]]) -> None:
        self.scripts, self._answered = scripts, 0

    def _row(self, kv) -> torch.Tensor:
        script, n = self._said[id(kv)]
        self._said[id(kv)] = (script, n + 1)
        row = torch.zeros(self.spec.vocab_size)
        row[script[min(n, len(script) - 1)]] = 30.0
        return row

    def prefill(self, kv, tokens, whole_prompt=False, want_logits=True):
        self.prompts.append(tokens.tolist())
        self._said[id(kv)] = (self.scripts[min(self._answered, len(self.scripts) - 1)], 0)
        self._answered += 1
        return self._row(kv)

    def prefill_many(self, kvs, chunks):
        return torch.stack([self.prefill(kv, c) for kv, c in zip(kvs, chunks, strict=True)])

    def decode(self, kvs, tokens):
        return torch.stack([self._row(kv) for kv in kvs])


@contextmanager
def scripted_engine(gguf: Path) -> Iterator[tuple[Engine, ScriptedRunner]]:
    """A started engine on the file's tokenizer and template, its runner scripted."""
    f = GGUFFile(gguf)
    runner = ScriptedRunner(load_reference_runner(f, spec_from_gguf(f)))
    engine = Engine(runner, tokenizer_from_gguf(f), EngineConfig(ctx_size=2048, prefix_cache=False))
    engine.start()
    try:
        yield engine, runner
    finally:
        engine.shutdown()


def http_client(engine: Engine, **state) -> TestClient:
    return TestClient(create_app(ServerState(model_name="m", engine=engine, **state)), raise_server_exceptions=False)


def client_for(engine: Engine, **state) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0,
                         http_client=http_client(engine, **state))


def say(engine: Engine, runner: ScriptedRunner, *texts: str, end: str = "<|im_end|>") -> None:
    """The model's next answers are `texts`, one a prompt (the last one from then on), each then
    `end`, the token that ends its turn (gpt-oss: <|return|>, or <|call|> after a call; GLM: <|user|>,
    or <|observation|> after a call)."""
    tok = engine.tokenizer
    end_id = tok.tokens.index(end)
    runner.set_scripts([[*tok.encode(text, add_special=False), end_id] for text in texts])


def prompt_text(engine: Engine, runner: ScriptedRunner) -> str:
    """The last prompt the model was given, special tokens written out."""
    return engine.tokenizer.decode(runner.prompts[-1], skip_special=False)
