"""Driving an engine by hand in tests: submit, then step until the requests have finished."""

from __future__ import annotations

from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.sampler import SamplingParams


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
