"""Short forwards through the decoder's row path (`Decoder.static_rows`, `Decoder._takes_static`)
against its segment path, on the CPU in fp32 with the torch twins of the fused ops (`DecodeOps`).

The two paths differ only in summation order (one q/k/v GEMM instead of three, SDPA over the
masked capacity instead of a causal one): TOL bounds max|diff| / max|ref| of the logits. Logits
are compared at every position, so a row that saw a later row's keys would fail.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from strata_mgpu.config import EngineConfig, LayerSplit
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model import decoder as decoder_module
from strata_mgpu.model import synthetic
from strata_mgpu.model.decoder import Decoder, RowAttention, Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.model.weights import load_weights
from strata_mgpu.split.runner import build_split
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import Stage, StageOptions
from tests.test_engine import run_all
from tests.test_kv_two_tier import staging, tokens, two_tier

TOL = 1e-5
CPU = StageOptions(device=torch.device("cpu"))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def model(tiny_gguf) -> ReferenceModel:
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    return ReferenceModel(spec, load_weights(f, spec))


def write_wide(path: Path) -> Path:
    """The tiny preset with 64 experts: a CPU stage gathers (does not stream) up to 31 rows of 2
    picks (the twin's workspace holds E picks), so its prompts can take the static path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(synthetic.PRESETS, "wide", replace(synthetic.PRESETS["tiny"], n_experts=64))
        synthetic.write_model(path, "wide", seed=5)
    return path


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory) -> Path:
    return write_wide(tmp_path_factory.mktemp("models") / "wide.gguf")


class StaticCalls:
    """Counts the forwards of `model` that take the row path (the switch set to `on`)."""

    def __init__(self, model: Decoder, on: bool):
        self.model, self.on, self.n = model, on, 0

    def __enter__(self) -> StaticCalls:
        own = self.model._layers

        def counted(x, segments, path):
            self.n += isinstance(path.attention, RowAttention)
            return own(x, segments, path)

        self.model._layers = counted
        self.model.static_rows = self.on
        return self

    def __exit__(self, *exc) -> None:
        del self.model._layers
        self.model.static_rows = False


def forward_logits(model: Decoder, chunks: list[torch.Tensor], kvs: list, static: bool) -> tuple[torch.Tensor, int]:
    """The chunks appended to their caches in one forward: logits at every row [sum T_i, V], and
    how many forwards took the static path."""
    ends = list(itertools.accumulate(c.shape[0] for c in chunks))
    segments = [Segment(end - c.shape[0], end, kv) for c, end, kv in zip(chunks, ends, kvs, strict=True)]
    with torch.inference_mode(), StaticCalls(model, static) as calls:
        logits = model.logits(model.forward(torch.cat(chunks), segments))
    return logits, calls.n


def test_one_prompt_from_an_empty_cache(model):
    prompt = tokens(model, 23, seed=1)
    kv_a, kv_b = model.new_cache(64, capacity=32), model.new_cache(64, capacity=32)
    a, n_a = forward_logits(model, [prompt], [kv_a], static=False)
    b, n_b = forward_logits(model, [prompt], [kv_b], static=True)
    assert (n_a, n_b) == (0, 1)
    assert b.shape == a.shape == (23, model.spec.vocab_size) and rel_err(b, a) <= TOL
    assert kv_a.length == kv_b.length == 23
    assert rel_err(kv_b.k[:, :23], kv_a.k[:, :23]) <= TOL and rel_err(kv_b.v[:, :23], kv_a.v[:, :23]) <= TOL


def test_a_chunk_continuing_a_cache(model):
    """A second chunk (kv.length > 0; the cache grows on reserve) attends over the first's keys."""
    prompt = tokens(model, 26, seed=2)
    kv_a, kv_b = model.new_cache(64, capacity=16), model.new_cache(64, capacity=16)
    for kv in (kv_a, kv_b):
        forward_logits(model, [prompt[:17]], [kv], static=False)
    a, _ = forward_logits(model, [prompt[17:]], [kv_a], static=False)
    b, n = forward_logits(model, [prompt[17:]], [kv_b], static=True)
    assert n == 1 and kv_b.capacity == 32 and kv_b.length == 26
    assert rel_err(b, a) <= TOL


def test_packed_segments_of_different_lengths(model):
    """prefill_many's pack: three sequences of 7, 1 and 12 new rows, the last after a prefix of
    5; every row's logits, then a batched decode step (one row a segment) through both paths."""
    prompts = [tokens(model, n, seed=3 + n) for n in (7, 1, 17)]
    caches = {static: [model.new_cache(64, capacity=8) for _ in prompts] for static in (False, True)}
    for kvs in caches.values():
        forward_logits(model, [prompts[2][:5]], [kvs[2]], static=False)
    rests = [prompts[0], prompts[1], prompts[2][5:]]
    a, _ = forward_logits(model, rests, caches[False], static=False)
    b, n = forward_logits(model, rests, caches[True], static=True)
    assert n == 1 and rel_err(b, a) <= TOL
    assert [kv.length for kv in caches[True]] == [7, 1, 17]
    step = [torch.tensor([t]) for t in (3, 4, 5)]
    a, _ = forward_logits(model, step, caches[False], static=False)
    b, n = forward_logits(model, step, caches[True], static=True)
    assert n == 1 and rel_err(b, a) <= TOL


def test_rows_see_no_later_row(model):
    """Causality on its own: a prompt's first rows have the same logits whatever follows them in
    the same forward (the static path writes every row's keys before any row attends)."""
    prompt, tail = tokens(model, 12, seed=4), tokens(model, 8, seed=5)
    alone, _ = forward_logits(model, [prompt], [model.new_cache(64)], static=True)
    first, n = forward_logits(model, [torch.cat([prompt, tail])], [model.new_cache(64)], static=True)
    assert n == 1 and rel_err(first[:12], alone) <= TOL
    assert rel_err(first[12:], alone[-1:].expand(8, -1)) > 0.1  # the later rows did change


def test_a_spilled_or_overflowing_two_tier_cache_takes_runs_path(model):
    """A two-tier cache (stage/kv/two_tier.py) takes the static path only while every cell, the new
    ones included, sits in its VRAM ring at its own position: not once it has spilled, nor for
    rows that would leave its window (run's path, with its prefetch and staging)."""
    st = staging(model, prefetch=True)
    prompt = tokens(model, 30, seed=6)
    kv_a, kv_b = two_tier(model, 16, st), two_tier(model, 16, st)
    a, n_a = forward_logits(model, [prompt[:10]], [kv_a], static=True)  # within the window
    b, n_b = forward_logits(model, [prompt[:10]], [kv_b], static=False)
    assert (n_a, n_b) == (1, 0) and rel_err(a, b) <= TOL
    a, n_a = forward_logits(model, [prompt[10:20]], [kv_a], static=True)  # past the window: it spills
    b, _ = forward_logits(model, [prompt[10:20]], [kv_b], static=False)
    assert n_a == 0 and kv_a.spilled and rel_err(a, b) <= TOL
    a, n_a = forward_logits(model, [prompt[20:22]], [kv_a], static=True)  # spilled
    b, _ = forward_logits(model, [prompt[20:22]], [kv_b], static=False)
    assert n_a == 0 and rel_err(a, b) <= TOL


def test_long_rereads_take_runs_path(model, monkeypatch):
    """A chunk whose rows would read their cache again more than STATIC_REREAD_CELLS takes run's
    path; one row a sequence (a decode batch) rereads nothing."""
    monkeypatch.setattr(decoder_module, "STATIC_REREAD_CELLS", 5 * 6)
    kv = model.new_cache(64)
    _, n = forward_logits(model, [tokens(model, 6, seed=7)], [kv], static=True)  # 5 x 6 cells
    assert n == 1
    _, n = forward_logits(model, [tokens(model, 6, seed=8)], [kv], static=True)  # 5 x 12
    assert n == 0
    _, n = forward_logits(model, [torch.tensor([1])], [kv], static=True)
    assert n == 1


def test_a_streaming_pass_takes_runs_path(wide_gguf):
    """On a stage, rows whose picks make the experts stream (32 rows x 2 of 64 experts) take run's
    path: the static step cannot stream. Fewer rows gather and take the static path."""
    f = GGUFFile(wide_gguf)
    stage = build_stage(f, spec_from_gguf(f), CPU)
    experts = stage.experts
    assert not experts.should_stream(31) and experts.should_stream(32)
    prompt = tokens(stage.model, 40, seed=9)
    kv_a, kv_b = stage.new_sequence(64), stage.new_sequence(64)
    a, n = forward_logits(stage.model, [prompt[:32]], [kv_a], static=True)
    b, _ = forward_logits(stage.model, [prompt[:32]], [kv_b], static=False)
    assert n == 0 and experts.streaming and torch.equal(a, b)
    a, n = forward_logits(stage.model, [prompt[32:]], [kv_a], static=True)
    b, _ = forward_logits(stage.model, [prompt[32:]], [kv_b], static=False)
    assert n == 1 and not experts.streaming and rel_err(a, b) <= TOL


SERVED = [list(range(5, 25)), [30, 31, 32], [40, 41, 42, 43, 44], [50, 51], [60]]


def greedy_served(runner, tok, stages: list[Stage], on: bool, prompts: list[list[int]] = SERVED,
                  max_tokens: int = 6) -> tuple[list[list[int]], int]:
    """Greedy tokens of short prompts (packed beside a chunked one) served by the engine with the
    stages' switch `on`; and how many forwards took the static path."""
    engine = Engine(runner, tok, EngineConfig(chunk_size=12, max_running=4))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    calls = [StaticCalls(stage.model, on) for stage in stages]
    for c in calls:
        c.__enter__()
    try:
        outs = run_all(engine, [(p, params) for p in prompts])
    finally:
        for c in calls:
            c.__exit__()
    return [[t for o in out for t in o.token_ids] for out in outs], sum(c.n for c in calls)


def test_engine_on_a_stage_serves_the_same_tokens(wide_gguf):
    f = GGUFFile(wide_gguf)
    stage, tok = build_stage(f, spec_from_gguf(f), CPU), tokenizer_from_gguf(f)
    want, n_off = greedy_served(stage, tok, [stage], on=False)
    got, n_on = greedy_served(stage, tok, [stage], on=True)
    assert n_off == 0 and n_on > 0 and got == want


def test_a_split_reaches_the_static_path_on_each_stage(wide_gguf):
    """split/runner.py's prompt and decode rows go through each stage's `Decoder.run`. (Few
    tokens: tests/test_ordering_stages.py reruns this under the ordering twin.)"""
    f = GGUFFile(wide_gguf)
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    split = build_split(f, spec, [CPU, CPU], LayerSplit((2,)))
    prompts = [list(range(5, 19)), [30, 31, 32], [50, 51]]
    want, _ = greedy_served(build_stage(f, spec, CPU), tok, [], False, prompts, max_tokens=3)
    got, n_on = greedy_served(split, tok, split.stages, True, prompts, max_tokens=3)
    assert got == want and n_on > 0
