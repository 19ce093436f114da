"""The KV pool's bookkeeping and the prefix cache's index over it, on blocks whose cells are Python
tuples of the tokens they hold (so a match can be checked to give exactly the prompt's rows); the
engine on a pool small enough that decode growth preempts (fp32, the CPU reference)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.prefix_cache import DEVICE, HOST, Node, PrefixCache, PrefixMatch
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_pool import BlockPool, BlockTable, PoolExhausted
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from tests.engine_runs import run_all, run_one

# -- BlockPool, BlockTable ----------------------------------------------------------------------

def test_an_allocation_takes_every_block_asked_for_or_none():
    pool = BlockPool(4, 16)
    first = pool.allocate(3)
    assert sorted(first) == [0, 1, 2] and pool.refs == [1, 1, 1, 0] and pool.free_blocks == 1
    with pytest.raises(PoolExhausted, match="1 free blocks"):
        pool.allocate(2)
    assert pool.refs == [1, 1, 1, 0] and pool.free_blocks == 1 and pool.used_blocks == 3


def test_the_reclaim_hook_is_asked_for_the_shortfall_and_what_it_gives_is_used():
    pool = BlockPool(4, 16)
    held = pool.allocate(3)
    asked: list[int] = []

    def reclaim(n: int) -> int:
        asked.append(n)
        give = held[:n]
        del held[:n]
        pool.unref(give)
        return len(give)

    pool.reclaim = reclaim
    assert pool.allocate(1) and asked == []  # one free: the hook is not asked
    got = pool.allocate(2)  # none free: the shortfall is 2
    assert asked == [2] and len(got) == 2 and pool.free_blocks == 0
    pool.reclaim = lambda n: asked.append(n) or 0  # gives nothing: nothing taken, PoolExhausted
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert asked == [2, 1] and pool.free_blocks == 0


def test_a_block_returns_to_the_free_list_with_its_last_reference():
    pool = BlockPool(2, 4)
    (b,) = pool.allocate(1)
    pool.ref([b])
    pool.ref([b])
    assert pool.refs[b] == 3
    pool.unref([b])
    pool.unref([b])
    assert pool.free_blocks == 1 and pool.refs[b] == 1
    pool.unref([b])
    assert pool.free_blocks == 2 and pool.refs[b] == 0
    with pytest.raises(AssertionError, match="free already"):
        pool.unref([b])
    with pytest.raises(AssertionError, match="is free"):
        pool.ref([b])


def test_a_table_grows_by_blocks_frees_once_and_never_past_its_most():
    pool = BlockPool(8, 4)
    table = BlockTable(pool, 10)  # 3 blocks at most
    assert table.max_blocks == 3 and table.missing(9) == 3
    table.ensure(5)
    assert len(table.ids) == 2 and table.tokens == 8 and pool.free_blocks == 6
    table.ensure(8)
    assert len(table.ids) == 2  # within its blocks: nothing taken
    with pytest.raises(ValueError, match="exceed the 12"):
        table.ensure(13)
    assert len(table.ids) == 2 and pool.free_blocks == 6  # refused: nothing taken
    other = BlockTable.adopt(pool, 16, table.ids)
    assert [pool.refs[b] for b in table.ids] == [2, 2]
    (own,) = pool.allocate(1)
    old = other.replace_last(own)
    assert old == table.ids[-1] and pool.refs[old] == 1 and other.ids == [table.ids[0], own]
    table.free()
    table.free()  # idempotent
    assert table.ids == [] and pool.refs[other.ids[0]] == 1 and pool.free_blocks == 8 - 2
    with pytest.raises(AssertionError, match="freed table"):
        table.ensure(1)


def test_a_table_that_cannot_grow_takes_nothing():
    pool = BlockPool(3, 4)
    a, b = BlockTable(pool, 12), BlockTable(pool, 12)
    a.ensure(8)
    with pytest.raises(PoolExhausted):
        b.ensure(8)
    assert b.ids == [] and pool.free_blocks == 1


# -- the prefix cache over a pool of token cells -------------------------------------------------

class CellPool:
    """A `KVPool` whose block b's cells are `cells[b]`, the tokens written there (None: not written);
    offloaded blocks are ("host", cells). `write` checks copy on write: a sequence writes only blocks
    it alone holds."""

    block_bytes = 1

    def __init__(self, n_blocks: int, block_tokens: int, host_tier: bool = True):
        self.blocks = BlockPool(n_blocks, block_tokens)
        self.host_tier = host_tier
        self.cells: list[tuple[int | None, ...]] = [(None,) * block_tokens for _ in range(n_blocks)]
        self.copies = self.loads = 0

    def copy_block(self, src: int, dst: int) -> None:
        assert self.blocks.refs[src] > 0 and self.blocks.refs[dst] > 0, "a copy touches a free block"
        self.cells[dst] = self.cells[src]
        self.copies += 1

    def offload(self, block: int) -> tuple[str, tuple[int | None, ...]]:
        assert self.blocks.refs[block] > 0, "a free block offloaded"
        assert self.host_tier, "a pool without a host tier offloaded a block"
        return ("host", self.cells[block])

    def load(self, data: tuple[str, tuple[int | None, ...]], block: int) -> None:
        assert data is not None, "a host block loaded after it was dropped"
        tier, cells = data
        assert tier == "host" and self.blocks.refs[block] > 0
        self.cells[block] = cells
        self.loads += 1

    def write(self, table: BlockTable, start: int, tokens: list[int]) -> None:
        b = self.blocks.block_tokens
        for p, t in enumerate(tokens, start):
            block = table.ids[p // b]
            assert self.blocks.refs[block] == 1, f"a sequence writes block {block}, which others hold"
            cells = list(self.cells[block])
            cells[p % b] = t
            self.cells[block] = tuple(cells)

    def rows(self, ids: list[int], n: int) -> list[int | None]:
        return [t for b in ids for t in self.cells[b]][:n]


@dataclass
class Seq:
    """A running sequence: its table and the tokens whose rows it has written."""

    table: BlockTable
    tokens: list[int]
    max_tokens: int


def give_back(cache: PrefixCache, table: BlockTable) -> None:
    """OutputProcessor.give_back's order: the table freed, then the cache told."""
    ids = list(table.ids)
    table.free()
    cache.released(ids)


def admit(pool: CellPool, cache: PrefixCache, prompt: list[int], max_tokens: int
          ) -> tuple[Seq | None, PrefixMatch | None]:
    """Scheduler._take_blocks on the cell pool: the cache's blocks (checked to hold the prompt's rows),
    the last one copied where it is shared in part, room for the rest and its first token, the rest
    computed. None where the pool cannot give that now (nothing kept)."""
    blocks, b = pool.blocks, pool.blocks.block_tokens
    found = cache.match(prompt)
    n_cached = found.n_tokens if found is not None else 0
    if found is not None:
        assert 0 < n_cached < len(prompt) and len(found.blocks) == -(-n_cached // b)
        assert pool.rows(found.blocks, n_cached) == prompt[:n_cached], "a match gave another prefix's rows"
    table = BlockTable(blocks, max_tokens, found.blocks if found is not None else ())
    partial = n_cached % b != 0
    need = table.missing(len(prompt) + 1) + partial
    if need > blocks.available(cache.reclaimable):
        give_back(cache, table)
        return None, found
    try:
        if partial:
            (own,) = blocks.allocate(1)
            pool.copy_block(table.ids[-1], own)
            cache.released([table.replace_last(own)])
        table.ensure(len(prompt) + 1)
    except PoolExhausted:
        give_back(cache, table)
        return None, found
    pool.write(table, n_cached, prompt[n_cached:])
    return Seq(table, list(prompt), max_tokens), found


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail, not hang, where a call loops (the reclaim of a cache whose idle blocks it cannot take)."""
    def expired(signum: int, frame: object) -> None:
        raise AssertionError(f"the call did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def nodes(cache: PrefixCache) -> list[Node]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


B = 2  # tokens a block: small, so prompts of a few tokens share and split blocks
BASES = ([1, 1, 2, 2, 0, 0, 1, 2], [1, 1, 2, 2, 2, 1], [2, 0, 2, 0])  # conversations that share blocks
prompts = st.builds(lambda base, cut, tail: base[:cut] + tail, st.sampled_from(BASES), st.integers(0, 8),
                    st.lists(st.integers(0, 2), max_size=3)).filter(bool)


class PoolAndCache(RuleBasedStateMachine):
    """A real BlockPool and PrefixCache over the cell pool, driven as the scheduler and the output
    processor drive them."""

    @initialize(n_blocks=st.integers(4, 14), host_room=st.integers(0, 4), host_tier=st.booleans())
    def make(self, n_blocks: int, host_room: int, host_tier: bool) -> None:
        self.pool = CellPool(n_blocks, B, host_tier)
        self.cache = PrefixCache(self.pool, host_bytes=host_room)
        self.live: list[Seq] = []

    def pick(self, i: int) -> Seq:
        return self.live[i % len(self.live)]

    @rule(prompt=prompts, extra=st.integers(1, 5))
    def admit(self, prompt: list[int], extra: int) -> None:
        with within(2):
            seq, _ = admit(self.pool, self.cache, prompt, len(prompt) + extra)
        if seq is not None:
            self.live.append(seq)

    @rule(prompt=prompts)
    def match_and_give_back(self, prompt: list[int]) -> None:
        """An admission that found no room: the match's references given back at once."""
        with within(2):
            found = self.cache.match(prompt)
        if found is not None:
            assert self.pool.rows(found.blocks, found.n_tokens) == prompt[:found.n_tokens]
            give_back(self.cache, BlockTable(self.pool.blocks, len(prompt), found.blocks))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20))
    def save_prompt(self, i: int) -> None:
        """Engine._save_prompts: the rows computed so far indexed."""
        seq = self.pick(i)
        self.cache.insert(seq.table, seq.tokens, len(seq.tokens))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), token=st.integers(0, 2))
    def decode(self, i: int, token: int) -> None:
        """One more row; where the pool runs dry, the sequence is preempted (its blocks back)."""
        seq = self.pick(i)
        if len(seq.tokens) + 1 > seq.max_tokens:
            return
        try:
            with within(2):
                seq.table.ensure(len(seq.tokens) + 1)
        except PoolExhausted:
            give_back(self.cache, seq.table)
            self.live.remove(seq)
            return
        self.pool.write(seq.table, len(seq.tokens), [token])
        seq.tokens.append(token)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), normally=st.booleans())
    def finish(self, i: int, normally: bool) -> None:
        """OutputProcessor.finish: a normal end indexes its rows, then its table goes back."""
        seq = self.pick(i)
        if normally:
            self.cache.insert(seq.table, seq.tokens, len(seq.tokens))
        give_back(self.cache, seq.table)
        self.live.remove(seq)

    @rule(n=st.integers(0, 6))
    def reclaim(self, n: int) -> None:
        """The pool's hook: every block only the cache holds can be given back, one each."""
        can, free = self.cache.reclaimable, self.pool.blocks.free_blocks
        with within(2):
            freed = self.cache.reclaim(n)
        assert freed == min(n, can) and self.pool.blocks.free_blocks == free + freed

    @rule()
    def clear(self) -> None:
        with within(2):
            self.cache.clear()
        for node in nodes(self.cache):
            assert node.block is not None and self.pool.blocks.refs[node.block] > 1, \
                "a reset kept a block no sequence holds"

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def references_are_the_tables_and_the_index(self) -> None:
        blocks = self.pool.blocks
        indexed = [n.block for n in nodes(self.cache) if n.block is not None]
        assert len(indexed) == len(set(indexed)), "a block indexed twice"
        for b in range(blocks.n_blocks):
            holders = sum(s.table.ids.count(b) for s in self.live) + (b in indexed)
            assert blocks.refs[b] == holders, f"block {b}: {blocks.refs[b]} references, {holders} holders"
        free = blocks._free
        assert len(free) == len(set(free)) and len(free) + blocks.used_blocks == blocks.n_blocks
        assert all(blocks.refs[b] == 0 for b in free)

    @invariant()
    def the_tiers_keep_their_room_and_their_counts(self) -> None:
        tree = nodes(self.cache)
        stats = self.cache.stats.blocks
        assert stats[DEVICE] == sum(n.tier == DEVICE for n in tree)
        assert stats[HOST] == sum(n.tier == HOST for n in tree) <= self.cache.host_blocks
        assert self.cache.reclaimable == sum(n.block is not None and self.pool.blocks.refs[n.block] == 1
                                             for n in tree)
        on_device = {n.block: n for n in tree if n.block is not None}
        assert self.cache._node_of == on_device, "a device node's block does not map back to it"

    @invariant()
    def device_nodes_come_first_and_hold_their_tokens(self) -> None:
        for node in nodes(self.cache):
            assert node.parent is not None and node.parent.children[node.tokens] is node
            if node.block is None:
                assert node.host is not None and node.host[1] == node.tokens
                assert all(c.block is None for c in node.children.values()), "a host node above a device one"
            else:
                assert self.pool.cells[node.block] == node.tokens, "an indexed block holds other tokens"

    @invariant()
    def every_sequence_holds_its_rows(self) -> None:
        for seq in self.live:
            assert self.pool.rows(seq.table.ids, len(seq.tokens)) == seq.tokens


PoolAndCache.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_pool_and_the_cache_keep_their_invariants = PoolAndCache.TestCase


def test_a_cache_whose_chain_a_sequence_continues_with_its_own_blocks_can_still_give_its_idle_ones():
    """A prompt computed twice before either was indexed: the first's chain is indexed, its deeper
    block dropped, and the second's copy of that block indexed under the first's shallower one. With
    the second still running, the first's block is the cache's alone: reclaimable, so reclaim gives
    it (and does not loop on it)."""
    pool = CellPool(6, B, host_tier=False)
    cache = PrefixCache(pool, host_bytes=0)
    prompt = [1, 1, 2, 2, 0]
    first, _ = admit(pool, cache, prompt, 8)
    second, _ = admit(pool, cache, prompt, 8)  # admitted in the same step: nothing indexed yet
    assert first is not None and second is not None
    cache.insert(first.table, first.tokens, 4)
    give_back(cache, first.table)
    assert cache.reclaim(1) == 1  # the deeper of the first's blocks
    cache.insert(second.table, second.tokens, 4)  # at the second's end of prompt
    can, free = cache.reclaimable, pool.blocks.free_blocks
    assert can == sum(n.block is not None and pool.blocks.refs[n.block] == 1 for n in nodes(cache))
    with within(2):
        freed = cache.reclaim(1)
    assert freed == min(1, can) and pool.blocks.free_blocks == free + freed


def test_a_host_block_a_match_is_bringing_back_is_not_dropped_by_the_room_it_makes():
    """Bringing back a chain of host blocks into a full pool reclaims idle device blocks, which go to
    a full host tier: the victims must not be the chain's own host blocks still to be loaded."""
    pool = CellPool(4, B)
    cache = PrefixCache(pool, host_bytes=2)
    chain = [1, 1, 2, 2]
    seq, _ = admit(pool, cache, chain + [0], 8)
    assert seq is not None
    cache.insert(seq.table, seq.tokens, 4)
    give_back(cache, seq.table)
    assert cache.reclaim(2) == 2 and cache.stats.blocks == {DEVICE: 0, HOST: 2}  # the chain on the host
    others = []
    for first in (5, 6):  # two idle device blocks of other prompts, and two running sequences' own
        other, _ = admit(pool, cache, [first, first, 0], 3)
        assert other is not None
        cache.insert(other.table, other.tokens, 2)
        others.append(other)
    give_back(cache, others[0].table)
    give_back(cache, others[1].table)
    hold = BlockTable(pool.blocks, 4)
    hold.ensure(4)  # the free blocks taken: the match must reclaim for each block it loads
    with within(2):
        found = cache.match(chain + [0])
    if found is not None:
        assert pool.rows(found.blocks, found.n_tokens) == chain[:found.n_tokens]
    tree = nodes(cache)
    assert cache.stats.blocks[HOST] == sum(n.tier == HOST for n in tree)
    assert cache.stats.blocks[DEVICE] == sum(n.tier == DEVICE for n in tree)


def test_the_engine_does_not_hang_where_a_running_sequence_continues_the_caches_chain_with_its_own_blocks(
        tiny_gguf):
    """The scheduler and the output processor driving the cache into the state of
    test_a_cache_whose_chain_a_sequence_continues_with_its_own_blocks_can_still_give_its_idle_ones: requests sharing
    a prompt's start, admitted before each other's prompts were indexed, on a pool of 10 blocks of 4
    that runs dry (arrivals at the steps given). Every request ends `length`; no reclaim loops."""
    from tests.test_engine import ScriptedRunner

    f = GGUFFile(tiny_gguf)
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    engine = Engine(ScriptedRunner(spec, [7] * 64, kv_token_budget=40), tok,
                    EngineConfig(ctx_size=40, prefix_block_tokens=4, chunk_size=4, max_running=3, arrival_gap_ms=0))
    start = [3, 3, 2, 3, 3]
    requests = [(0, start + [1, 1, 1, 2, 3, 1, 1, 3], 3), (3, start + [1, 1, 1, 2, 3, 1, 1, 3, 3, 1, 1, 1, 3, 2], 8),
                (4, start + [2, 3], 10), (6, start + [1, 1, 1, 2, 3, 1, 1, 1, 3, 1, 1], 2)]
    outs: list[list] = [[] for _ in requests]
    with within(5):
        for step in range(200):
            for (at, prompt, n), out in zip(requests, outs, strict=True):
                if at == step:
                    engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), out.append)
            if step > 6 and all(o and o[-1].finished for o in outs):
                break
            engine.step()
    assert [(o[-1].finish_reason, o[-1].n_generated) for o in outs] == [("length", n) for _, _, n in requests]
    assert engine.pool.blocks.used_blocks == engine.prefix.stats.blocks[DEVICE]


# -- the target: a shared system prompt held once --------------------------------------

def test_a_3k_system_prompt_is_held_once_across_16_running_sequences(tiny_gguf):
    """The real scheduler over a pool of 64-token blocks (a runner whose sequences hold no rows): the
    first request computes the system prompt, 15 more arrive with it; all 16 run together, and the pool
    holds its 48 blocks once: used blocks = the shared ones + each sequence's own."""
    from tests.test_engine import ScriptedPool, ScriptedRunner

    class Blocks64(ScriptedRunner):
        def kv_pool(self, block_tokens: int, cells: int) -> ScriptedPool:
            pool = ScriptedPool(1)
            pool.blocks = BlockPool(48 + 16 * 5, block_tokens)
            return pool

    f = GGUFFile(tiny_gguf)
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    runner = Blocks64(spec, [7] * 64, kv_token_budget=128 * 64)
    engine = Engine(runner, tok, EngineConfig(ctx_size=4096, prefix_block_tokens=64, chunk_size=4096,
                                              max_running=16, arrival_gap_ms=0))
    system = [(i * 7) % 2000 + 1 for i in range(3072)]  # 48 blocks
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs: list[list] = [[] for _ in range(16)]
    engine.submit(system + [3] * 40, params, outs[0].append)
    engine.step()  # its prompt computed and indexed
    for i in range(1, 16):
        engine.submit(system + [10 + i] * (20 + 10 * i), params, outs[i].append)
    engine.step()
    engine.step()
    running = engine.scheduler.running
    assert len(running) == 16 and all(r.n_prefilled == len(r.prompt) for r in running)
    blocks = engine.pool.blocks
    assert blocks.block_tokens == 64
    shared = running[0].table.ids[:48]
    assert all(r.table.ids[:48] == shared for r in running)
    assert all(blocks.refs[b] == 16 + 1 for b in shared)  # 16 sequences and the cache's index
    own = sum(len(r.table.ids) - 48 for r in running)
    assert blocks.used_blocks == 48 + own
    assert all(o[-1].timings.cache_n == 3072 for o in outs[1:] if o and o[-1].finished)
    while not all(o and o[-1].finished for o in outs):
        engine.step()
    assert [o[-1].timings.cache_n for o in outs] == [0] + [3072] * 15


# -- the engine on a pool that runs dry ----------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    return load_reference_runner(f, spec), tokenizer_from_gguf(f)


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_decode_growth_past_the_pool_preempts_and_every_request_gets_its_greedy_tokens(loaded, prefix_cache):
    """ctx 64 and blocks of 16 give the CPU pool 8 blocks (twice the cells of a context): four
    requests of 20 prompt and 40 drawn tokens are admitted on 2 blocks each and need 4 each by their
    end. Every one ends `length` with exactly the tokens it draws alone (fp32, no tolerance); the
    pool ran dry (preemptions counted); at the end every block is free or the cache's."""
    runner, tok = loaded
    config = EngineConfig(ctx_size=64, prefix_block_tokens=16, chunk_size=64, prefix_cache=prefix_cache)
    engine = Engine(runner, tok, config)
    assert engine.pool.blocks.n_blocks == 8
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, runner.spec.vocab_size, (20,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = [tokens_of(run_one(Engine(runner, tok, EngineConfig(ctx_size=64, prefix_cache=False)), p, params))
             for p in prompts]
    outs = run_all(engine, [(p, params) for p in prompts])
    assert [o[-1].finish_reason for o in outs] == ["length"] * 4
    assert [tokens_of(o) for o in outs] == alone
    (line,) = [x for x in engine.metrics.render().decode().splitlines() if x.startswith("strata_preemptions_total")]
    assert float(line.split()[1]) > 0
    blocks = engine.pool.blocks
    cached = engine.prefix.stats.blocks[DEVICE] if engine.prefix is not None else 0
    assert blocks.used_blocks == cached and all(r <= 1 for r in blocks.refs)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from strata_mgpu.model.synthetic import write_model

    path = tmp_path_factory.mktemp("models") / "small.gguf"
    write_model(path, "small", seed=2)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    return load_reference_runner(f, spec), tokenizer_from_gguf(f)


def test_a_3_turn_chat_continued_from_the_cache_draws_what_the_whole_prompt_draws(small):
    """The `small` preset, fp32, blocks of 64: each turn is the last prompt, its answer and new text;
    from the second on most of it comes from the cache (the answer's rows as decode steps wrote them),
    and its 64 greedy tokens equal those of the whole prompt computed in one chunk, no cache."""
    runner, tok = small
    cached = Engine(runner, tok, EngineConfig(prefix_block_tokens=64))
    whole = Engine(runner, tok, EngineConfig(prefix_cache=False))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, runner.spec.vocab_size, (300,), generator=g).tolist()
    for turn in range(3):
        outs = run_one(cached, prompt, params)
        got = tokens_of(outs)
        assert got == tokens_of(run_one(whole, prompt, params)), f"turn {turn}"
        assert outs[-1].timings.cache_n == (0 if turn == 0 else (len(prompt) - 40 - 1) // 64 * 64)
        prompt = prompt + got + torch.randint(0, runner.spec.vocab_size, (40,), generator=g).tolist()


class _GrowsWhileRead(list):
    """A table's ids that another thread extends the moment they are sliced (a split's shared table: the
    engine's thread reserves the next step's block while a stage's thread copies the ids it knows)."""

    def __init__(self, ids, extra):
        super().__init__(ids)
        self.extra = extra

    def __getitem__(self, index):
        got = super().__getitem__(index)
        if isinstance(index, slice) and self.extra:
            self.append(self.extra.pop())
        return got


def test_a_tables_device_ids_stay_its_ids_while_another_thread_grows_it():
    """`PagedKV` copies the ids it read once; the block appended meanwhile is copied by the next sync,
    not written over its neighbour's entry (read twice, the slice's length grew under the copy: one id
    broadcast into two entries, the second block's writes landing in the first's cells)."""
    from strata_mgpu.model.kv_cache import KVFormat
    from strata_mgpu.model.kv_pool import KVStorage, PagedKV

    pool = BlockPool(8, 4)
    storage = KVStorage(1, 1, 2, n_blocks=8, block_tokens=4, device="cpu", format=KVFormat(torch.float32))
    table = BlockTable(pool, 32)
    kv = PagedKV(storage, table, max_length=32)
    table.ids = _GrowsWhileRead(pool.allocate(1), pool.allocate(1))
    kv.reserve(4)  # syncs: reads one id, and the other thread appends a second meanwhile
    kv.reserve(8)  # the next sync copies it
    assert kv.block_table is not None and kv.block_table[:2].tolist() == list(table.ids) and len(table.ids) == 2
