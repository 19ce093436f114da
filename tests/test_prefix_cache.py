"""The prefix cache over the KV pool: a continuation on shared blocks equals the prompt computed whole
(fp32, on the CPU reference, one CPU stage and a CPU split), through the engine too. The index, its
tiers and the pool's counts on plain Python blocks: tests/test_kv_pool.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from strata_mgpu.config import EngineConfig, LayerSplit
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.prefix_cache import DEVICE
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_pool import BlockTable
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.split.runner import build_split
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from tests.engine_runs import run_one as run

CPU = StageOptions(device=torch.device("cpu"), chunk_size=256)


@pytest.fixture(scope="module")
def model(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    return f, spec, tokenizer_from_gguf(f)


def runners(model):
    f, spec, _ = model
    return {"reference": load_reference_runner(f, spec), "stage": build_stage(f, spec, CPU),
            "split": build_split(f, spec, [CPU, CPU], LayerSplit((2,)))}


@pytest.mark.parametrize("kind", ["reference", "stage", "split"])
def test_continuation_on_shared_blocks_equals_the_prompt_computed_whole(model, kind):
    """A sequence whose table starts with another's blocks (half of them back from host RAM, the last
    one shared in part and so copied) continues as the prompt computed whole, for 32 greedy steps."""
    runner = runners(model)[kind]
    vocab = runner.spec.vocab_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (150,), generator=g)
    pool = runner.kv_pool(16, 512)
    blocks = pool.blocks

    whole = runner.new_sequence(256, BlockTable(blocks, 256))
    want = runner.prefill(whole, prompt)

    first_table = BlockTable(blocks, 256)
    first = runner.new_sequence(256, first_table)
    runner.prefill(first, prompt[:100])
    shared = first_table.ids[:100 // 16]  # 6 full blocks: 96 tokens
    for b in shared[:3]:  # through the host tier: offloaded, and loaded into another block
        data = pool.offload(b)
        (moved,) = blocks.allocate(1)
        pool.load(data, moved)
        shared[shared.index(b)] = moved
    table = BlockTable.adopt(blocks, 256, shared)
    (own,) = blocks.allocate(1)  # 90 of the 96: the last block is written to, so a copy of its own
    pool.copy_block(table.ids[-1], own)
    table.replace_last(own)
    again = runner.new_sequence(256, table, 90)
    assert again.length == 90
    got = runner.prefill(again, prompt[90:])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    chain = []
    for kv in (whole, again):  # 32 greedy steps on each
        tokens, logits = [], want if kv is whole else got
        for _ in range(32):
            tokens.append(int(logits.argmax()))
            logits = runner.decode([kv], torch.tensor(tokens[-1:]))[0]
        chain.append(tokens)
    assert chain[0] == chain[1]
    # the first sequence's rows are untouched by the second's writes
    again_first = runner.prefill(first, prompt[100:])
    torch.testing.assert_close(again_first, want, rtol=1e-5, atol=1e-5)


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("kind", ["reference", "split"])
def test_a_conversation_computes_each_turn_past_what_it_has_seen(model, kind):
    """Three turns, each the last prompt + its answer + new text: every turn after the first takes
    its prefix from the cache (at block granularity) and generates what a cache-less engine does."""
    runner = runners(model)[kind]
    _, _, tok = model
    config = EngineConfig(chunk_size=48, prefix_block_tokens=16)
    cached, plain = Engine(runner, tok, config), Engine(runner, tok, EngineConfig(chunk_size=48, prefix_cache=False))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, runner.spec.vocab_size, (70,), generator=g).tolist()
    new: list[int] = []
    for turn in range(3):
        outs = run(cached, prompt, params)
        assert tokens_of(outs) == tokens_of(run(plain, prompt, params))
        t = outs[-1].timings
        assert t.cache_n + t.prompt_n == len(prompt)
        if turn == 0:
            assert t.cache_n == 0
        else:  # the last turn's prompt and answer, but for the rows of its last token and past the last block
            seen = len(prompt) - len(new)
            assert seen - 16 - 1 < t.cache_n <= seen
        new = torch.randint(0, runner.spec.vocab_size, (20,), generator=g).tolist()
        prompt = prompt + tokens_of(outs) + new
    stats = cached.prefix.stats
    assert stats.hits == 2 and stats.queries == 3


def test_requests_sharing_a_prompt_find_it_while_the_first_still_decodes(model):
    f, spec, tok = model
    runner = load_reference_runner(f, spec)
    engine = Engine(runner, tok, EngineConfig(prefix_block_tokens=16, arrival_gap_ms=0))
    system = list(range(5, 5 + 64))
    outs = [[], []]
    engine.submit(system + [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), outs[0].append)
    for _ in range(3):
        engine.step()  # the first prompt is computed and decodes
    engine.submit(system + [7, 8], SamplingParams(max_tokens=4, ignore_eos=True), outs[1].append)
    while not all(o and o[-1].finished for o in outs):
        engine.step()
    assert outs[0][-1].timings.cache_n == 0
    assert outs[1][-1].timings.cache_n == 64  # all four blocks of the system prompt
    assert engine.prefix.stats.blocks[DEVICE] == 64 // 16 + 40 // 16 + 0  # shared blocks held once
    assert engine.pool.blocks.used_blocks == engine.prefix.stats.blocks[DEVICE]  # and nothing else once both end


def test_an_aborted_request_leaves_no_block_and_a_reset_clears_the_cache(model):
    f, spec, tok = model
    runner = load_reference_runner(f, spec)
    engine = Engine(runner, tok, EngineConfig(prefix_block_tokens=16, chunk_size=32))
    outs: list[RequestOutput] = []
    rid = engine.submit(list(range(3, 103)), SamplingParams(max_tokens=8, ignore_eos=True), outs.append)
    engine.step()  # its first chunk of 32
    engine.abort(rid)
    engine.step()
    assert engine.n_running == 0 and engine.prefix.stats.blocks[DEVICE] == 0
    run(engine, list(range(3, 103)), SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.prefix.stats.blocks[DEVICE] == (100 + 8 - 1) // 16
    done = engine.reset_prefix_cache()
    engine.step()
    assert done.result(timeout=1) == (100 + 8 - 1) // 16 and engine.prefix.stats.blocks[DEVICE] == 0


def test_no_prefix_cache_computes_every_prompt_whole(model):
    f, spec, tok = model
    engine = Engine(load_reference_runner(f, spec), tok, EngineConfig(prefix_cache=False))
    prompt = list(range(3, 200))
    for _ in range(2):
        t = run(engine, prompt, SamplingParams(max_tokens=2, ignore_eos=True))[-1].timings
        assert t.cache_n == 0 and t.prompt_n == len(prompt)
    assert engine.prefix is None


# -- what the server reports ------------------------------------------------------------------

@pytest.fixture()
def client(model):
    from fastapi.testclient import TestClient

    from strata_mgpu.server.app import ServerState, create_app
    f, spec, tok = model
    engine = Engine(load_reference_runner(f, spec), tok, EngineConfig(prefix_block_tokens=16))
    engine.start()
    yield TestClient(create_app(ServerState(model_name="m", engine=engine)))
    engine.shutdown()


def test_the_server_reports_cached_tokens_and_resets_the_cache(client):
    system = "You are a careful assistant. " * 12
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0}
    first = client.post("/v1/chat/completions", json=body).json()
    second = client.post("/v1/chat/completions", json=body).json()
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} and first["timings"]["prompt_n"] == n
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert n - 16 <= cached < n and second["timings"]["cache_n"] == cached
    assert second["timings"]["prompt_n"] == n - cached and second["usage"]["prompt_tokens"] == n
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    metrics = client.get("/metrics").text
    assert f"strata_prefix_cache_tokens_total {float(cached)}" in metrics
    assert "strata_prefix_cache_hits_total 1.0" in metrics
    r = client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["dropped_blocks"] >= n // 16
    third = client.post("/v1/chat/completions", json=body).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_kv_cells_planned_are_one_context_or_more():
    assert EngineConfig(ctx_size=1000).kv_cells(4096) == 1000
    assert EngineConfig(ctx_size=1000, kv_tokens=500).kv_cells(4096) == 1000  # a whole-context sequence fits
    assert EngineConfig(ctx_size=1000, kv_tokens=4000).kv_cells(4096) == 4000
    with pytest.raises(ValueError, match="--kv-tokens"):
        EngineConfig(kv_tokens=0)


def test_a_request_longer_than_the_pool_is_never_indexed(model):
    """A prompt longer than the stage's pool runs two-tier, the pool's blocks its VRAM ring (a block
    holds whatever positions last passed through it): its blocks are never cached, so the same prompt
    again, and one sharing its head, compute whole and draw what a cache-less engine draws."""
    f, spec, tok = model
    stage = build_stage(f, spec, StageOptions(device=torch.device("cpu"), chunk_size=32, kv_tokens=64, context=256))
    config = EngineConfig(chunk_size=32, prefix_block_tokens=16)
    cached, plain = Engine(stage, tok, config), Engine(stage, tok, replace(config, prefix_cache=False))
    assert cached.pool.blocks.n_blocks * 16 == 64
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    long = torch.randint(0, spec.vocab_size, (150,), generator=g).tolist()
    short = long[:40]  # fits the pool: it may be cached, but must not find the long one's ring
    for prompt in (long, long, short, short):
        outs = run(cached, prompt, params)
        assert tokens_of(outs) == tokens_of(run(plain, prompt, params))
        if prompt is long:
            assert outs[-1].timings.cache_n == 0
    assert run(cached, short, params)[-1].timings.cache_n > 0  # the short prompt's own blocks are cached
