"""The prefix cache: a continuation on cached blocks equals the prompt computed whole (fp32, on the
CPU reference, one CPU stage and a CPU split), through the engine too; the cache's tree, tiers,
pins and budget on a store of plain Python blocks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_mgpu.config import EngineConfig, LayerSplit
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.prefix_cache import DEVICE, HOST, PrefixCache
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
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
def test_continuation_on_cached_blocks_equals_the_prompt_computed_whole(model, kind):
    runner = runners(model)[kind]
    vocab = runner.spec.vocab_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (150,), generator=g)
    store = runner.kv_blocks(16)

    whole = runner.new_sequence(256)
    want = runner.prefill(whole, prompt)

    first = runner.new_sequence(256)
    runner.prefill(first, prompt[:100])
    blocks = [store.save(first, j) for j in range(100 // 16)]  # 6 blocks: 96 tokens
    blocks = [store.offload(b) for b in blocks[:3]] + blocks[3:]  # half from the host tier
    again = runner.new_sequence(256)
    store.load(again, blocks, 90)  # part of the last block only
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


# -- the tree, tiers and pins, on plain Python blocks ------------------------------------------

@dataclass
class Seq:
    """A sequence of `tokens` whose row r holds token r."""

    tokens: list[int]
    length: int = 0
    nbytes: int = 0


class ListBlocks:
    """Blocks as lists of the tokens they hold, tagged with their tier: `load` checks that a
    sequence gets exactly its prompt's rows."""

    def __init__(self, block_tokens: int, host_tier: bool = True):
        self.block_tokens, self.block_bytes, self.host_tier = block_tokens, 1, host_tier
        self.loaded: list[tuple[str, ...]] = []

    def cacheable(self, kv: Seq) -> bool:
        return True

    def save(self, kv: Seq, index: int):
        b = self.block_tokens
        assert (index + 1) * b <= kv.length
        return ("device", tuple(kv.tokens[index * b:(index + 1) * b]))

    def offload(self, block):
        assert block[0] == "device"
        return ("host", block[1])

    def load(self, kv: Seq, blocks, n_tokens: int) -> None:
        rows = [t for _, held in blocks for t in held][:n_tokens]
        assert rows == kv.tokens[:n_tokens], "a block came back with another prefix's rows"
        self.loaded.append(tuple(tier for tier, _ in blocks))
        kv.length = n_tokens


def computed(tokens: list[int]) -> Seq:
    return Seq(tokens, length=len(tokens))


def test_the_longest_cached_chain_is_taken_and_its_last_token_computed():
    store = ListBlocks(4)
    cache = PrefixCache(store, host_bytes=100)
    cache.insert(computed(list(range(12))), list(range(12)), 12)
    assert cache.match([9, 9, 9, 9, 9]) is None
    found = cache.match(list(range(8)) + [50, 51, 52, 53])
    assert found is not None and found.n_tokens == 8 and len(found.blocks) == 2
    whole = cache.match(list(range(12)))
    assert whole is not None and whole.n_tokens == 11 and len(whole.blocks) == 3  # its last token computed
    kv = Seq(list(range(12)))
    cache.restore(kv, whole)
    assert kv.length == 11 and all(b.pins == 0 for b in whole.blocks[2:])
    cache.release(found)
    assert all(b.pins == 0 for b in found.blocks)


def test_device_blocks_move_to_host_then_drop_least_recently_used_first():
    store = ListBlocks(2)
    cache = PrefixCache(store, host_bytes=3)  # three blocks of host tier
    a, b = [1, 1, 2, 2, 3, 3], [7, 7, 8, 8]
    cache.insert(computed(a), a, 6)
    cache.insert(computed(b), b, 4)
    assert cache.device_cells == 10
    cache.release(cache.match(b + [0]))  # b is the more recently used
    cache.shrink_device(4)  # a's three blocks to the host
    assert cache.stats.blocks == {DEVICE: 2, HOST: 3}
    cache.shrink_device(0)  # b's must go too: the host drops a's deepest first
    assert cache.stats.blocks[DEVICE] == 0 and cache.stats.blocks[HOST] == 3
    kv = Seq(b + [0])
    cache.restore(kv, cache.match(b + [0]))
    assert store.loaded[-1] == ("host", "host")
    assert cache.match(a) is not None and cache.match(a).n_tokens == 2  # only a's first block is left
    assert cache.stats.dropped_blocks == 2


def test_pinned_blocks_stay_through_shrinks_and_resets():
    store = ListBlocks(2)
    cache = PrefixCache(store, host_bytes=0)  # no host tier room: moving a block out drops it
    a = [1, 2, 3, 4]
    cache.insert(computed(a), a, 4)
    found = cache.match(a + [5])
    cache.shrink_device(0)
    assert cache.clear() == 0 and cache.stats.blocks[DEVICE] == 2
    cache.restore(Seq(a + [5]), found)
    assert cache.clear() == 2 and cache.match(a + [5]) is None


def test_one_tier_caches_within_its_room():
    store = ListBlocks(2, host_tier=False)  # the device is the host: --cache-ram bounds the only tier
    cache = PrefixCache(store, host_bytes=2)
    seq = list(range(10))
    assert cache.insert(computed(seq), seq, 10) == 2  # its own first blocks are never dropped for its later ones
    assert cache.device_cells == 0 and cache.stats.blocks[DEVICE] == 2
    other = [50, 51, 52, 53]
    assert cache.insert(computed(other), other, 4) == 2  # the older chain makes room
    assert cache.match(seq) is None and cache.match(other + [0]).n_tokens == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "match", "shrink", "clear"]),
                          st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(0, 12)),
                max_size=25),
       st.integers(0, 6))
def test_the_tiers_never_exceed_their_room_and_every_restore_is_exact(ops, host_room):
    store = ListBlocks(2)
    cache = PrefixCache(store, host_bytes=host_room)
    pinned = []
    for op, tokens, n in ops:
        if op == "insert":
            cache.insert(computed(tokens), tokens, n)
        elif op == "match":
            found = cache.match(tokens)
            if found is not None:
                if n % 2:
                    pinned.append(found)
                else:
                    cache.restore(Seq(tokens), found)
        elif op == "shrink":
            cache.shrink_device(n)
            assert cache.device_cells <= max(n, sum(2 for f in pinned for b in f.blocks if b.tier == DEVICE))
        else:
            cache.clear()
        assert cache.stats.blocks[HOST] <= host_room
        live = list(cache._walk())
        assert cache.stats.blocks[DEVICE] == sum(b.tier == DEVICE for b in live)
        assert cache.stats.blocks[HOST] == sum(b.tier == HOST for b in live)
    for found in pinned:
        cache.release(found)
    assert all(b.pins == 0 for b in cache._walk())


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
