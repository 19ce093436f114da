"""Driving an engine by hand in tests: submit, then step until the requests have finished."""

from __future__ import annotations

import torch

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.runner import DecoderRunner
from strata_mgpu.model.tokenizer import Tokenizer


def run_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]], max_steps: int = 10_000
            ) -> list[list[RequestOutput]]:
    """Submit all, step the engine by hand until every request has finished (at most `max_steps`)."""
    outs: list[list[RequestOutput]] = [[] for _ in requests]
    for (prompt, params), out in zip(requests, outs, strict=True):
        engine.submit(prompt, params, out.append)
    for _ in range(max_steps):
        if all(o and o[-1].finished for o in outs):
            return outs
        engine.step()
    raise AssertionError("engine did not finish")


def run_one(engine: Engine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """One request's outputs, the engine stepped by hand until it has finished."""
    return run_all(engine, [(prompt, params)])[0]


def assert_engine_draws_the_greedy_chains(runner: DecoderRunner, tok: Tokenizer, steps: int = 8) -> None:
    """Prompts in chunks of 5, two running at once with a third queued: each request's greedy tokens
    are the reference's argmax chain over its whole prompt (a hybrid's DeltaNet state beside its KV)."""
    prompts = [tok.encode("The sea is wide, the sea is deep."), tok.encode("def f(x):\n    return x"),
               tok.encode("Hello")]
    engine = Engine(runner, tok, EngineConfig(chunk_size=5, max_running=2))
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    outs = run_all(engine, [(p, params) for p in prompts])
    model = runner.model
    for prompt, out in zip(prompts, outs, strict=True):
        kv, linear = model.new_cache(4096), model.new_linear_state()
        logits = model.prefill(torch.tensor(prompt), kv, linear)[-1]
        chain = []
        for _ in range(steps):
            chain.append(int(logits.argmax()))
            logits = model.prefill(torch.tensor(chain[-1:]), kv, linear)[-1]
        assert [t for o in out for t in o.token_ids] == chain
