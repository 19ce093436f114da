"""The server-shaped decode measurement on the tiny model: its report's shape and sums (not speed)."""

from __future__ import annotations

import pytest

from strata_mgpu.config import EngineConfig
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.tools.server_decode import bench_prompts, measure_server_decode


@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return load_reference_runner(f, spec_from_gguf(f)), tokenizer_from_gguf(f)


def test_report_counts_add_up(loaded):
    runner, tok = loaded
    report = measure_server_decode(runner, tok, n_requests=3, max_tokens=6, prompt_tokens=5, warmup_tokens=2)
    assert report.n_requests == len(report.requests) == 3 and report.max_running == 3
    assert report.n_generated == sum(r.n_generated for r in report.requests) == 3 * 6
    assert {r.request_id for r in report.requests} == {"bench-0", "bench-1", "bench-2"}
    for r in report.requests:
        assert r.n_prompt_tokens == 5 and 0 < r.ttft_s <= report.wall_s
        assert r.decode_tok_per_s == pytest.approx(5 / r.decode_s)
    assert report.aggregate_tok_per_s == pytest.approx(18 / report.wall_s)
    assert report.max_ttft_s >= report.mean_ttft_s > 0
    assert "3 request(s) x 6 tokens" in report.summary()
    assert report.as_dict()["requests"][0]["n_generated"] == 6


def test_a_small_batch_limit_queues_requests(loaded):
    runner, tok = loaded
    report = measure_server_decode(runner, tok, n_requests=3, max_tokens=3, prompt_tokens=4, warmup_tokens=0,
                                   config=EngineConfig(max_running=1))
    assert report.n_generated == 9 and report.max_running == 1
    assert report.steady_tok_per_s is None  # never were all three decoding at once
    ttfts = sorted(r.ttft_s for r in report.requests)
    assert ttfts[0] < ttfts[1] < ttfts[2]


def test_prompts_differ_and_have_the_asked_length(loaded):
    prompts = bench_prompts(loaded[1], 4, 9)
    assert all(len(p) == 9 for p in prompts) and len({tuple(p) for p in prompts}) == 4
