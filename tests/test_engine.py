from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import ContextOverflow, Engine, RequestOutput
from strata_mgpu.engine.sampler import SamplingParams, StopMatcher
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_pool import BlockPool
from strata_mgpu.model.runner import DecoderRunner, load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from tests.engine_runs import run_all
from tests.sampling_twin import Sampler


@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    return load_reference_runner(f, spec), tokenizer_from_gguf(f)


def greedy_chain(runner, prompt: list[int], n: int) -> list[int]:
    model = runner.model
    kv = model.new_cache(4096)
    logits = model.prefill(torch.tensor(prompt), kv)[-1]
    chain = []
    for _ in range(n):
        chain.append(int(logits.argmax()))
        logits = model.prefill(torch.tensor(chain[-1:]), kv)[-1]
    return chain


def test_greedy_tokens_equal_reference_argmax_chain(loaded):
    runner, tok = loaded
    prompts = [tok.encode("The sea is wide, the sea is deep."), tok.encode("def f(x):\n    return x"),
               tok.encode("Hello")]
    engine = Engine(runner, tok, EngineConfig(chunk_size=5, max_running=2))  # chunks, and a queue
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = run_all(engine, [(p, params) for p in prompts])
    for prompt, out in zip(prompts, outs, strict=True):
        got = [t for o in out for t in o.token_ids]
        assert got == greedy_chain(runner, prompt, 12)
        assert out[-1].finish_reason == "length" and out[-1].n_generated == 12
        assert "".join(o.text for o in out) == tok.decode(got)
        t = out[-1].timings
        assert t.prompt_n == len(prompt) and t.predicted_n == 12 and t.prompt_ms > 0


def test_abort_frees_the_kv_cache_at_once(loaded):
    runner, tok = loaded
    engine = Engine(runner, tok, EngineConfig())
    outs: list[RequestOutput] = []
    rid = engine.submit(tok.encode("a long story"), SamplingParams(max_tokens=1000, ignore_eos=True), outs.append)
    for _ in range(3):
        engine.step()
    assert engine.n_running == 1 and engine.kv_bytes > 0
    engine.abort(rid)
    engine.step()
    assert engine.n_running == 0 and engine.kv_bytes == 0
    assert not any(o.finished for o in outs)  # an aborted request is not answered any more


def test_abort_while_queued_is_logged_and_counted(loaded, caplog):
    runner, tok = loaded
    engine = Engine(runner, tok, EngineConfig(max_running=1))
    outs: list[RequestOutput] = []
    engine.submit(tok.encode("first"), SamplingParams(max_tokens=50, ignore_eos=True), outs.append)
    queued = engine.submit(tok.encode("second"), SamplingParams(max_tokens=50, ignore_eos=True), outs.append)
    engine.step()
    assert engine.n_waiting == 1
    engine.abort(queued)
    with caplog.at_level("INFO", logger="strata.engine"):
        engine.step()
    assert engine.n_waiting == 0 and engine.n_running == 1
    assert any(queued in r.getMessage() and "abort" in r.getMessage() for r in caplog.records)
    assert engine.metrics.registry.get_sample_value("strata_requests_total", {"finish_reason": "abort"}) == 1
    assert all(o.request_id != queued for o in outs)


def test_context_overflow_and_bad_prompts(loaded):
    runner, tok = loaded
    engine = Engine(runner, tok, EngineConfig(ctx_size=64))
    with pytest.raises(ContextOverflow) as e:
        engine.submit([1] * 60, SamplingParams(max_tokens=5), lambda o: None)
    assert e.value.n_ctx == 64 and e.value.n_prompt_tokens == 60
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], SamplingParams(max_tokens=5), lambda o: None)
    with pytest.raises(ValueError, match="token ids"):
        engine.submit([10**6], SamplingParams(max_tokens=5), lambda o: None)


def test_eos_and_stop_string_end_generation(loaded):
    runner, tok = loaded
    prompt = tok.encode("Hello there")
    chain = greedy_chain(runner, prompt, 8)
    text = tok.decode(chain)
    stop = text[3:6]  # lands inside the generated text, likely across tokens
    engine = Engine(runner, tok, EngineConfig())
    (out,) = run_all(engine, [(prompt, SamplingParams(max_tokens=8, temperature=0, stop=(stop,)))])
    assert out[-1].finish_reason == "stop"
    assert "".join(o.text for o in out) == text[:text.index(stop)]


def test_seed_gives_same_samples(loaded):
    runner, tok = loaded
    engine = Engine(runner, tok, EngineConfig())
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = tok.encode("Tell me a story")
    a, b = run_all(engine, [(prompt, p), (prompt, p)])
    c, = run_all(engine, [(prompt, SamplingParams(**{**p.__dict__, "seed": 99}))])
    ids = [[t for o in out for t in o.token_ids] for out in (a, b, c)]
    assert ids[0] == ids[1] != ids[2]


def test_background_thread(loaded):
    runner, tok = loaded
    engine = Engine(runner, tok, EngineConfig())
    engine.start()
    done = threading.Event()
    outs: list[RequestOutput] = []

    def on(o: RequestOutput) -> None:
        outs.append(o)
        if o.finished:
            done.set()

    engine.submit(tok.encode("Hi"), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), on)
    assert done.wait(30)
    engine.shutdown()
    assert outs[-1].n_generated == 5


class WarmingRunner(DecoderRunner):
    """The reference runner with a decode-graph warm-up that records its calls."""

    def __init__(self, model):
        super().__init__(model)
        self.warmed: list[int] = []

    def warm_decode_graphs(self, context: int) -> list[int]:
        self.warmed.append(context)
        return [1, 2, 4, 8]


def test_start_captures_the_decode_graphs_first(loaded, cpu_stage, caplog):
    runner, tok = loaded
    warming = WarmingRunner(runner.model)
    engine = Engine(warming, tok, EngineConfig(ctx_size=512))
    with caplog.at_level("INFO", logger="strata.engine"):
        engine.start()
    engine.shutdown()
    assert warming.warmed == [engine.n_ctx] == [512]
    assert "decode graphs for batches of 1, 2, 4, 8 rows captured" in caplog.text
    assert cpu_stage.warm_decode_graphs(512) == []  # no graphs on the CPU: nothing to capture


# -- packed prefill ------------------------------------------------------------------------------

class CountingRunner(DecoderRunner):
    """The reference runner, logging its prefill calls."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[tuple[str, list[int]]] = []

    def prefill(self, kv, tokens, whole_prompt=False, want_logits=True):
        self.calls.append(("prefill", [len(tokens)]))
        return super().prefill(kv, tokens, whole_prompt, want_logits)

    def prefill_many(self, kvs, chunks):
        self.calls.append(("prefill_many", [len(c) for c in chunks]))
        return super().prefill_many(kvs, chunks)


@pytest.fixture(scope="module")
def cpu_stage(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return build_stage(f, spec_from_gguf(f), StageOptions(device=torch.device("cpu")))


@pytest.mark.parametrize("kind", ["reference", "stage"])
def test_prefill_many_equals_one_at_a_time(loaded, cpu_stage, kind):
    runner = loaded[0] if kind == "reference" else cpu_stage
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, runner.spec.vocab_size, (n,), generator=g) for n in (7, 1, 12)]
    one = [runner.new_sequence(64) for _ in prompts]
    many = [runner.new_sequence(64) for _ in prompts]
    runner.prefill(one[2], prompts[2][:5])  # the third continues after a prefix, in both
    runner.prefill(many[2], prompts[2][:5])
    rests = [prompts[0], prompts[1], prompts[2][5:]]
    want = torch.stack([runner.prefill(kv, rest) for kv, rest in zip(one, rests, strict=True)])
    got = runner.prefill_many(many, rests)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert [kv.length for kv in many] == [kv.length for kv in one] == [7, 1, 12]
    nxt = torch.tensor([3, 4, 5])
    torch.testing.assert_close(runner.decode(many, nxt), runner.decode(one, nxt), rtol=1e-4,
                               atol=1e-4 * float(want.abs().max()))


def test_short_prompts_are_packed_beside_a_chunk(loaded):
    runner, tok = loaded
    counting = CountingRunner(runner.model)
    prompts = [list(range(5, 25)), [30, 31, 32], [40, 41, 42, 43], [50, 51]]
    engine = Engine(counting, tok, EngineConfig(chunk_size=12, max_running=4))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = run_all(engine, [(p, params) for p in prompts])
    # the shorts whose rests fit half the chunk go beside the long prompt's first chunk (SHORT_SHARE)
    assert counting.calls == [("prefill_many", [7, 3, 2]), ("prefill_many", [8, 4]), ("prefill", [5])]
    for prompt, out in zip(prompts, outs, strict=True):
        assert [t for o in out for t in o.token_ids] == greedy_chain(runner, prompt, 5)


def test_arrivals_together_get_their_first_token_together(loaded):
    runner, tok = loaded
    engine = Engine(CountingRunner(runner.model), tok, EngineConfig())
    outs: list[list[RequestOutput]] = [[] for _ in range(6)]
    for i, out in enumerate(outs):
        engine.submit([7 + i] * (3 + i), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), out.append)
    engine.step()  # one packed prefill (and the first decode step), launched
    engine.step()  # ... landed
    assert all(out for out in outs)
    assert engine.runner.calls == [("prefill_many", [3, 4, 5, 6, 7, 8])]


@pytest.mark.parametrize("gap_ms", [0.0, 50.0])
def test_an_idle_engine_gathers_a_burst_of_arrivals_into_one_prefill(loaded, gap_ms):
    """Requests arriving a few ms apart at an idle engine (the engine on its thread, as served):
    with an arrival gap they pack into one prefill; with none the first starts alone at once."""
    runner, tok = loaded
    counting = CountingRunner(runner.model)
    engine = Engine(counting, tok, EngineConfig(arrival_gap_ms=gap_ms))
    engine.start()
    outs: list[list[RequestOutput]] = [[] for _ in range(4)]
    done = threading.Semaphore(0)

    def on(out: list[RequestOutput]):
        def append(o: RequestOutput) -> None:
            out.append(o)
            if o.finished:
                done.release()
        return append

    try:
        for i, out in enumerate(outs):
            engine.submit([7 + i] * 5, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), on(out))
            time.sleep(0.01 if gap_ms else 0.2)  # within the gap; without one, long after the first started
        for _ in outs:
            assert done.acquire(timeout=30)
    finally:
        engine.shutdown()
    prefills = [call for call in counting.calls if call[0].startswith("prefill")]
    assert prefills == ([("prefill_many", [5, 5, 5, 5])] if gap_ms else [("prefill", [5])] * 4)


def test_arrival_gap_is_checked():
    with pytest.raises(ValueError, match="arrival gap"):
        EngineConfig(arrival_gap_ms=-1)


# -- the pipelined step, on a scripted runner ----------------------------------------------------

@dataclass
class ScriptedKV:
    max_length: int
    length: int = 0
    n_decoded: int = 0
    nbytes: int = 1

    def grow(self, n: int) -> None:
        self.length += n
        assert self.length <= self.max_length, "the engine ran a sequence past its context"


class ScriptedPool:
    """Blocks of 4 tokens whose cells are nowhere: the scripted sequences hold no rows."""

    block_bytes, host_tier = 1, False

    def __init__(self, n_blocks: int):
        self.blocks = BlockPool(n_blocks, 4)

    def copy_block(self, src: int, dst: int) -> None:
        pass

    def offload(self, block: int) -> None:
        raise AssertionError("a pool without a host tier offloaded a block")

    def load(self, data, block: int) -> None:
        raise AssertionError("a pool without a host tier loaded a block")


@dataclass
class ScriptedRunner:
    """Every sequence generates `script`, greedily: each call's logits put the mass on the
    script's next token. Checks that every decode is fed the token drawn before it, and logs
    its calls in `events` (which the test's on_output shares)."""

    spec: object
    script: list[int]
    events: list[tuple] = field(default_factory=list)
    kv_token_budget: int | None = None
    faults: int = 0  # `silent_faults`: what a test raises where the device would fail without raising

    def silent_faults(self) -> int:
        return self.faults

    @property
    def max_context(self) -> int:
        """No host tier: a sequence is at most the whole budget."""
        return self.kv_token_budget or self.spec.context_length

    def warm_decode_graphs(self, context: int) -> list[int]:
        return []

    def kv_pool(self, block_tokens: int, cells: int) -> ScriptedPool:
        return ScriptedPool(-(-(self.kv_token_budget or 2 * cells) // 4))

    def new_sequence(self, max_length: int, table=None, length: int = 0, state=None) -> ScriptedKV:
        return ScriptedKV(max_length, length)

    def mark_states(self, kv: ScriptedKV, boundaries) -> None:
        pass

    def taken_states(self, kv: ScriptedKV) -> dict:
        return {}

    def _row(self, kv: ScriptedKV) -> torch.Tensor:
        row = torch.zeros(self.spec.vocab_size)
        row[self.script[kv.n_decoded]] = 30.0
        return row

    def prefill(self, kv: ScriptedKV, tokens: torch.Tensor, whole_prompt: bool = False,
                want_logits: bool = True) -> torch.Tensor:
        kv.grow(len(tokens))
        self.events.append(("prefill", len(tokens)))
        return self._row(kv)

    def prefill_many(self, kvs, chunks) -> torch.Tensor:
        self.events.append(("prefill_many", [len(c) for c in chunks]))
        for kv, chunk in zip(kvs, chunks, strict=True):
            kv.grow(len(chunk))
        return torch.stack([self._row(kv) for kv in kvs])

    def decode(self, kvs, tokens: torch.Tensor) -> torch.Tensor:
        self.events.append(("decode", len(kvs)))
        rows = []
        for kv, fed in zip(kvs, tokens.tolist(), strict=True):
            assert fed == self.script[kv.n_decoded], "decode was not fed the token drawn before"
            kv.grow(1)
            kv.n_decoded += 1
            rows.append(self._row(kv))
        return torch.stack(rows)


def scripted(loaded, script: list[int], **engine_kw) -> tuple[Engine, ScriptedRunner]:
    runner, tok = loaded
    fake = ScriptedRunner(runner.spec, script)
    return Engine(fake, tok, EngineConfig(**engine_kw)), fake


def test_next_step_launches_before_the_host_sees_the_last_token(loaded):
    tok = loaded[1]
    script = tok.encode("one two three four five six", add_special=False)[:6]
    engine, fake = scripted(loaded, script, ctx_size=64)
    out: list[RequestOutput] = []
    engine.submit([1, 2, 3], SamplingParams(max_tokens=6, temperature=0), lambda o: (out.append(o),
                                                                                  fake.events.append(("out",))))
    while not (out and out[-1].finished):
        engine.step()
    assert [t for o in out for t in o.token_ids] == script
    kinds = [e[0] for e in fake.events]
    # step 1: the prefill, its first token landed at once, then a decode; step 2: a decode, then
    # the host lands step 1's decoded token while step 2 runs
    assert kinds[:6] == ["prefill", "out", "decode", "decode", "out", "decode"], kinds
    assert kinds.count("decode") == 5  # max_tokens is known from the count: no sixth step


def test_a_first_token_does_not_wait_for_the_decode_step(loaded):
    """Time to first token is the prompt's: the first token is out before any decode is launched."""
    engine, fake = scripted(loaded, [7, 8, 9, 10], ctx_size=64)
    out: list[RequestOutput] = []
    engine.submit([1, 2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                  lambda o: (out.append(o), fake.events.append(("out",))))
    engine.step()
    assert [e[0] for e in fake.events][:2] == ["prefill", "out"] and out[0].token_ids == [7]
    assert out[0].n_prompt_tokens == 2 and not out[0].finished


def test_eos_is_known_a_step_late_and_its_successor_dropped(loaded):
    tok = loaded[1]
    eos = min(tok.eot_ids)
    words = tok.encode("alpha beta gamma delta epsilon", add_special=False)
    script = [*words[:3], eos, *words[3:5]]
    engine, fake = scripted(loaded, script, ctx_size=64)
    (out,) = run_all(engine, [([5, 6], SamplingParams(max_tokens=6, temperature=0))])
    assert [t for o in out for t in o.token_ids] == words[:3]
    assert out[-1].finish_reason == "stop" and out[-1].n_generated == 4
    assert "".join(o.text for o in out) == tok.decode(words[:3])
    assert [e for e in fake.events if e[0] == "decode"] == [("decode", 1)] * 4  # one speculative step


def test_stop_string_drops_the_speculative_token(loaded):
    tok = loaded[1]
    script = tok.encode("red green blue black white", add_special=False)
    text = tok.decode(script)
    stop = " blue"
    n_stop = next(n for n in range(1, len(script) + 1) if stop in tok.decode(script[:n]))
    engine, fake = scripted(loaded, script, ctx_size=64)
    (out,) = run_all(engine, [([5, 6], SamplingParams(max_tokens=len(script), temperature=0, stop=(stop,)))])
    assert out[-1].finish_reason == "stop" and out[-1].n_generated == n_stop
    assert "".join(o.text for o in out) == text[:text.index(stop)]
    assert len([e for e in fake.events if e[0] == "decode"]) == n_stop  # n_stop - 1 needed, one dropped


def test_a_failed_decode_ends_its_requests_and_the_engine_goes_on(loaded):
    engine, fake = scripted(loaded, [9] * 10, ctx_size=64)
    real_decode, calls = fake.decode, []

    def failing(kvs, tokens):
        calls.append(len(kvs))
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return real_decode(kvs, tokens)

    fake.decode = failing
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first, = run_all(engine, [([1, 2], params)])
    assert first[-1].finish_reason == "error" and "device fell over" in first[-1].error
    assert first[-1].n_generated == 3  # the tokens drawn before the failed step still landed
    second, = run_all(engine, [([3, 4], params)])
    assert second[-1].finish_reason == "length" and second[-1].n_generated == 8


def test_a_step_whose_work_failed_silently_ends_its_requests_not_with_its_tokens(loaded):
    """A failure the device goes on past (a hand-over the host never answered) during a decode
    step: every step that lands after the count rose and was launched before it may hold wrong
    tokens and KV, so its requests end with an error (500, saying why) rather than take them; the
    tokens landed before stay theirs, and a request admitted afterwards runs to its end."""
    tok = loaded[1]
    script = tok.encode("one two three four five six seven eight nine ten", add_special=False)[:10]
    engine, fake = scripted(loaded, script, ctx_size=64)
    real_decode, calls = fake.decode, []

    def failing_silently(kvs, tokens):
        calls.append(len(kvs))
        if len(calls) == 3:
            fake.faults += 1  # as a hand-over's status word set while the third step runs
        return real_decode(kvs, tokens)

    fake.decode = failing_silently
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first, = run_all(engine, [([1, 2], params)])
    assert first[-1].finish_reason == "error" and "expert hand-over" in first[-1].error
    assert first[-1].error_status == 500
    # the prompt's token and the first step's landed; the fault was seen (here at once, as the third
    # step was queued) before the second step landed, which was in flight with the third: both dropped
    assert [t for o in first for t in o.token_ids] == script[:2]
    second, = run_all(engine, [([3, 4], params)])
    assert second[-1].finish_reason == "length" and [t for o in second for t in o.token_ids] == script[:8]


def test_a_prompt_whose_earlier_chunk_failed_silently_ends_when_its_first_token_lands(loaded):
    """A fault while a prompt's first chunk ran (a chunk that draws no token) still fails the
    request, when its first token lands after the last chunk; a prompt begun after it does not."""
    engine, fake = scripted(loaded, [7] * 10, ctx_size=64, chunk_size=4)
    real_prefill = fake.prefill

    def failing_in_the_first_chunk(kv, tokens, whole_prompt=False, want_logits=True):
        out = real_prefill(kv, tokens, whole_prompt, want_logits)
        if kv.length == len(tokens):  # the first chunk of its sequence
            fake.faults += 1
        return out

    fake.prefill = failing_in_the_first_chunk
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first, = run_all(engine, [(list(range(1, 11)), params)])  # three chunks: 4, 4, 2 tokens
    assert first[-1].finish_reason == "error" and "expert hand-over" in first[-1].error
    assert [t for o in first for t in o.token_ids] == []
    fake.prefill = real_prefill
    second, = run_all(engine, [(list(range(1, 11)), params)])
    assert second[-1].finish_reason == "length" and second[-1].n_generated == 3


def test_admission_keeps_within_the_kv_budget(loaded):
    tok = loaded[1]
    script = tok.encode("a b c d e f g h i j k l m n o p q r s t", add_special=False)
    fake = ScriptedRunner(loaded[0].spec, script, kv_token_budget=30)
    engine = Engine(fake, tok, EngineConfig(ctx_size=64, prefix_cache=False))
    assert engine.n_ctx == 30  # no single sequence can be longer than the whole budget
    with pytest.raises(ContextOverflow) as e:
        engine.submit([1] * 21, SamplingParams(max_tokens=10), lambda o: None)
    assert e.value.n_ctx == 30
    outs: list[list[RequestOutput]] = [[] for _ in range(3)]
    for i in range(3):  # a prompt and its first token take 2 of the pool's 8 blocks: all three are admitted
        engine.submit([1, 2, 3, 4, 5], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), outs[i].append)
    engine.step()
    assert engine.n_running == 3 and engine.pool.blocks.free_blocks == 2
    while not all(o and o[-1].finished for o in outs):
        engine.step()
    assert all(o[-1].finish_reason == "length" and o[-1].n_generated == 2 for o in outs)
    assert engine.pool.blocks.free_blocks == 8  # every block back


def test_each_steps_plan_says_what_its_calls_run(loaded):
    """The scheduler's plan of each step: the prefill call's chunks (the first prompt's next chunk
    after the later prompts whose rests fit half the chunk, whole; then whole prompts in the room
    left) and the decode rows, those whose prompt this step's prefill ends among them unless their
    first token is their last; the calls follow it."""
    engine, fake = scripted(loaded, [7] * 20, chunk_size=12, max_running=5, ctx_size=64)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ids = [engine.submit(p, params, lambda o: None) for p in (list(range(5, 25)), [30, 31, 32], [40, 41, 42, 43])]
    ids.append(engine.submit([50, 51], SamplingParams(max_tokens=1, temperature=0), lambda o: None))
    plans = [engine.scheduler.schedule()]  # admits all four
    engine.step()
    for _ in range(2):
        plans.append(engine.scheduler.plan())
        engine.step()
    chunks = [[(c.request.id, c.start, len(c.tokens)) for c in plan.prefill] for plan in plans]
    # half of 12 holds the 3- and 2-token prompts (not the 4 beside the 3); the 20 takes the other 7
    assert chunks == [[(ids[0], 0, 7), (ids[1], 0, 3), (ids[3], 0, 2)], [(ids[0], 7, 8), (ids[2], 0, 4)],
                      [(ids[0], 15, 5)]]
    # ids[3]: its one token drawn by its prefill
    assert [[r.id for r in plan.decode] for plan in plans] == [[ids[1]], ids[1:3], ids[:3]]
    assert fake.events == [("prefill_many", [7, 3, 2]), ("decode", 1), ("prefill_many", [8, 4]), ("decode", 2),
                           ("prefill", 5), ("decode", 3)]


def test_a_short_request_sent_during_a_long_prompt_does_not_wait_for_its_end(loaded):
    """A 3-token request sent while a 160-token prompt computes in 16-token chunks gets its first
    token from the step after it arrives (the long prompt has eight chunks to go); the long
    prompt's greedy tokens are those it gets alone, its chunks cut elsewhere."""
    runner, tok = loaded
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    long_prompt = [5 + i % 200 for i in range(160)]
    (alone,) = run_all(Engine(runner, tok, EngineConfig(chunk_size=16)), [(long_prompt, params)])
    engine = Engine(runner, tok, EngineConfig(chunk_size=16, max_running=4))
    long_out: list[RequestOutput] = []
    short_out: list[RequestOutput] = []
    engine.submit(long_prompt, params, long_out.append)
    for _ in range(2):
        engine.step()
    engine.submit(tok.encode("Hi"), params, short_out.append)
    steps = 0
    while not short_out:
        engine.step()
        steps += 1
    assert steps <= 2 and not long_out  # landed a step after its launch, the long prompt still computing
    while not (long_out and long_out[-1].finished and short_out[-1].finished):
        engine.step()
    assert [t for o in long_out for t in o.token_ids] == [t for o in alone for t in o.token_ids]


def test_a_step_launched_by_hand_lands_like_a_step(loaded):
    """The launch and the landing as `step` runs them, called by hand (as the GPU test of a launch
    without a host sync does): the request still gets the tokens of an engine left to itself."""
    runner, tok = loaded
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
    prompt = tok.encode("Hello")
    (alone,) = run_all(Engine(runner, tok, EngineConfig()), [(prompt, params)])
    engine = Engine(runner, tok, EngineConfig())
    out: list[RequestOutput] = []
    engine.submit(prompt, params, out.append)
    for _ in range(4):
        engine.step()
    launched = engine._launch(engine.scheduler.plan())
    assert launched is not None and launched.n_decode_rows == 1
    engine._in_flight, previous = launched, engine._in_flight
    assert previous is not None
    engine._land(previous)
    while not (out and out[-1].finished):
        engine.step()
    assert out[-1].n_generated == 12 and out[-1].finish_reason == "length"
    assert [t for o in out for t in o.token_ids] == [t for o in alone for t in o.token_ids]


def test_sampled_requests_repeat_alone_or_in_a_batch(loaded):
    runner, tok = loaded
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=77, ignore_eos=True)
    prompt = tok.encode("Once upon a time")
    alone, = run_all(Engine(runner, tok, EngineConfig()), [(prompt, p)])
    other = SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, presence_penalty=0.5)
    _, crowd, _ = run_all(Engine(runner, tok, EngineConfig(chunk_size=4)),
                          [(tok.encode("Hi there"), other), (prompt, p), (tok.encode("x = 1"), other)])
    assert [t for o in crowd for t in o.token_ids] == [t for o in alone for t in o.token_ids]


# -- sampler -------------------------------------------------------------------------------------

def test_sampler_rules():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(500, generator=g)
    top = int(logits.argmax())
    assert Sampler(SamplingParams(max_tokens=1, temperature=0)).sample(logits) == top
    assert Sampler(SamplingParams(max_tokens=1, top_k=1)).sample(logits) == top
    assert Sampler(SamplingParams(max_tokens=1, top_p=1e-6)).sample(logits) == top
    assert Sampler(SamplingParams(max_tokens=1, min_p=1.0)).sample(logits) == top
    draws = {Sampler(SamplingParams(max_tokens=1, top_k=3, seed=s)).sample(logits) for s in range(60)}
    assert draws == set(torch.topk(logits, 3).indices.tolist())
    s = Sampler(SamplingParams(max_tokens=5, temperature=0, presence_penalty=2.0, frequency_penalty=2.0))
    picks = [s.sample(logits) for _ in range(3)]
    assert len(set(picks)) == 3  # penalties push the greedy pick off repeated tokens
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=1, top_p=0)


@pytest.mark.parametrize("pieces, stops, emitted, stopped", [
    (["Hel", "lo wor", "ld"], ("lo w",), "Hel", True),
    (["ab", "c", "d"], ("cd",), "ab", True),
    (["ab", "c", "x"], ("cd",), "abcx", False),
    (["x<", "|e", "nd|>tail"], ("<|end|>",), "x", True),
    (["no stops here"], (), "no stops here", False),
])
def test_stop_matcher_across_pieces(pieces, stops, emitted, stopped):
    m = StopMatcher(stops)
    out, hit = "", False
    for p in pieces:
        text, hit = m.feed(p)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == (emitted, stopped)


def test_a_queued_requests_wait_is_its_queue_time_not_its_prompt_time(loaded, monkeypatch):
    """timings.queue_ms counts submission to the first prompt chunk (here: the whole first request,
    with one slot); prompt_ms starts there. Both end up in the final output's timings. Held by the
    order of events, not by how long anything takes: the submissions, steps, prefill calls and
    outputs are logged with perf_counter readings (the engine's clock, read on this thread), and
    each figure lies between the readings of the events around its own two."""
    runner, tok = loaded
    engine = Engine(runner, tok, EngineConfig(max_running=1))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [tok.encode("first prompt"), tok.encode("second")]
    events: list[tuple[str, int]] = []  # (what, request; -1 for a step), in the order they happen
    stamps: list[float] = []  # perf_counter() at each event

    def log(what: str, i: int) -> None:
        events.append((what, i))
        stamps.append(time.perf_counter())

    def at(what: str, i: int) -> float:
        return stamps[events.index((what, i))]

    prefill, prefill_many = runner.prefill, runner.prefill_many

    def logged_prefill(kv, tokens, *args, **kwargs):
        log("prefill", prompts.index(tokens.tolist()))  # each prompt is one chunk
        return prefill(kv, tokens, *args, **kwargs)

    def logged_prefill_many(kvs, chunks):
        for chunk in chunks:
            log("prefill", prompts.index(chunk.tolist()))
        return prefill_many(kvs, chunks)

    monkeypatch.setattr(runner, "prefill", logged_prefill)
    monkeypatch.setattr(runner, "prefill_many", logged_prefill_many)
    outs: list[list[RequestOutput]] = [[], []]
    for i, prompt in enumerate(prompts):
        log("submit", i)
        engine.submit(prompt, params, lambda o, i=i: (outs[i].append(o), log("final" if o.finished else "out", i)))
        log("submitted", i)
    while not all(out and out[-1].finished for out in outs):
        log("step", -1)
        engine.step()
    # one slot: the second prompt runs only once the first request has finished
    assert [e for e in events if e[0] in ("prefill", "final")] == [("prefill", 0), ("final", 0), ("prefill", 1),
                                                                   ("final", 1)]
    t1, t2 = outs[0][-1].timings, outs[1][-1].timings
    assert t1 is not None and t2 is not None
    for i, t in enumerate((t1, t2)):
        step = stamps[max(k for k in range(events.index(("prefill", i))) if events[k][0] == "step")]
        # submission, then the first chunk's launch: in its step, before its prefill call
        assert 1e3 * (step - at("submitted", i)) <= t.queue_ms <= 1e3 * (at("prefill", i) - at("submit", i))
        # from the first chunk's launch to the first token's output
        assert 0 < t.prompt_ms <= 1e3 * (at("out", i) - step)
        assert 0 <= t.predicted_ms <= 1e3 * (at("final", i) - at("prefill", i))
    assert t2.queue_ms >= t1.prompt_ms + t1.predicted_ms  # it waited for the whole first request
    assert t2.as_dict()["queue_ms"] == t2.queue_ms


def test_a_callback_that_raises_ends_its_request_and_the_engine_goes_on(loaded):
    """A client whose callback fails (its event loop closed under a late output) loses its request;
    the engine's thread lives on and serves the next one."""
    runner, tok = loaded
    engine = Engine(runner, tok, EngineConfig(arrival_gap_ms=0))
    engine.start()
    try:
        def gone(out: RequestOutput) -> None:
            raise RuntimeError("Event loop is closed")

        engine.submit(tok.encode("a long story"), SamplingParams(max_tokens=50, ignore_eos=True), gone)
        done = threading.Event()
        outs: list[RequestOutput] = []

        def keep(out: RequestOutput) -> None:
            outs.append(out)
            if out.finished:
                done.set()

        engine.submit(tok.encode("Hello"), SamplingParams(max_tokens=4, ignore_eos=True), keep)
        assert done.wait(60), "the engine's thread died with the first request's callback"
        assert outs[-1].finish_reason == "length" and engine._thread is not None and engine._thread.is_alive()
        deadline = time.time() + 30
        while engine.n_running and time.time() < deadline:
            time.sleep(0.01)
        assert engine.n_running == 0  # the failed client's request was ended, not left decoding
    finally:
        engine.shutdown()
