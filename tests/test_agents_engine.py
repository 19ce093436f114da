"""The engine's side of agents: grammars (compiled once, masks on the device for the constrained
rows only, each mask after the token before it has landed, the grammar's end ending the request),
logprobs from the model's log-softmax, and logit biases."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest
import torch

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.device_sampler import BatchSampler
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.grammar import CACHE_SIZE, GrammarCompiler, GrammarError, allowed_tokens, fill_bitmasks
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.server.grammars import text_grammar
from tests import engine_runs

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["C", "F"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["city", "days", "unit", "tags"], "additionalProperties": False}


def run_all(engine, requests):
    return engine_runs.run_all(engine, requests, max_steps=5_000)  # as this module always bounded it


@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    tok = tokenizer_from_gguf(f)
    return load_reference_runner(f, spec), tok, GrammarCompiler(tok, spec.vocab_size)


def tokens_of(out: list[RequestOutput]) -> list[int]:
    return [t for o in out for t in o.token_ids]


def test_json_schema_answers_validate_on_the_random_model_beside_free_rows(loaded, caplog):
    """Constrained rows (greedy and sampled) in one batch with free ones: each constrained answer
    is JSON that validates, ended by the grammar (stop, no EOS needed); every token was one the
    grammar allowed after the tokens before it; the free rows draw what they draw alone."""
    runner, tok, compiler = loaded
    grammar = compiler.compile(text_grammar(SCHEMA))
    free = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
    constrained = [SamplingParams(max_tokens=120, temperature=t, seed=s, grammar=grammar)
                   for t, s in [(0, 0), (0.9, 1), (1.2, 2)]]
    prompts = [tok.encode(f"Weather report number {i}:") for i in range(len(constrained))]
    free_prompt = tok.encode("A free row")
    (alone,) = run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)), [(free_prompt, free)])
    engine = Engine(runner, tok, EngineConfig(chunk_size=8, prefix_cache=False))
    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        outs = run_all(engine, [(free_prompt, free), *zip(prompts, constrained, strict=True)])
    assert not [r for r in caplog.records if "refused" in r.getMessage()]
    assert tokens_of(outs[0]) == tokens_of(alone)
    for out in outs[1:]:
        answer = json.loads("".join(o.text for o in out))
        jsonschema.validate(answer, SCHEMA)
        assert out[-1].finish_reason == "stop"
        replay = grammar.matcher()
        assert all(replay.accept(t) for t in tokens_of(out)) and replay.done


def test_a_cut_off_constrained_answer_ends_with_length(loaded):
    runner, tok, compiler = loaded
    grammar = compiler.compile(text_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 50}))
    (out,) = run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)),
                     [(tok.encode("numbers"), SamplingParams(max_tokens=10, temperature=1.0, seed=1, grammar=grammar))])
    text = "".join(o.text for o in out)
    assert out[-1].finish_reason == "length" and out[-1].n_generated == 10 and text.startswith("[")


def test_a_lark_grammar_forces_its_text_and_its_end_stops_the_request(loaded):
    runner, tok, compiler = loaded
    grammar = compiler.compile('start: "yes, " ("left" | "right") "."\n')
    outs = run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)),
                   [(tok.encode(f"Which way {i}?"), SamplingParams(max_tokens=30, temperature=1.0, seed=i,
                                                                   grammar=grammar)) for i in range(4)])
    for out in outs:
        assert "".join(o.text for o in out) in ("yes, left.", "yes, right.") and out[-1].finish_reason == "stop"


def test_grammars_compile_once_and_bad_ones_say_why(loaded):
    _, tok, compiler = loaded
    text = text_grammar({"type": "object", "properties": {"x": {"type": "integer"}}})
    assert compiler.compile(text) is compiler.compile(text)
    with pytest.raises(GrammarError, match="foo"):
        compiler.compile(text_grammar({"type": "foo"}))
    with pytest.raises(GrammarError):
        compiler.compile("start: ???\n")
    small = GrammarCompiler(tok, compiler.vocab_size)
    for i in range(CACHE_SIZE + 3):
        small.compile(f'start: "{i}"\n')
    assert len(small) == CACHE_SIZE


def test_masks_expand_bit_by_bit_and_only_constrained_rows_change(loaded):
    """The sampler's mask on synthetic logits: a constrained row draws only allowed tokens, even
    where the logits favour a forbidden one; the rows without a grammar draw as they would alone."""
    _, tok, compiler = loaded
    vocab = compiler.vocab_size
    grammar = compiler.compile('start: "x" | "y"\n')
    m = grammar.matcher()
    bits = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    fill_bitmasks([m], bits)
    allowed = allowed_tokens(bits, vocab)[0]
    want = {i for i in range(vocab) if tok.tokens[i] in ("x", "y")}
    assert set(torch.nonzero(allowed).flatten().tolist()) == want
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, tok.tokens.index("z")] = 50.0  # what the model wants, and the grammar forbids
    sampler = BatchSampler()
    params = [SamplingParams(max_tokens=4, temperature=0.0, grammar=grammar),
              SamplingParams(max_tokens=4, temperature=1.0, seed=9),
              SamplingParams(max_tokens=4, temperature=0.7, seed=3, grammar=grammar),
              SamplingParams(max_tokens=4, temperature=0.0)]
    tokens = sampler.sample(logits, [sampler.open(p) for p in params]).tolist()
    assert tokens[0] in want and tokens[2] in want
    assert tokens[0] == max(want, key=lambda i: float(logits[0, i]))  # greedy: the best allowed
    free = BatchSampler()
    assert free.sample(logits[[1, 3]], [free.open(params[1]), free.open(params[3])]).tolist() == [tokens[1], tokens[3]]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 2048, 5003])
def test_mask_words_expand_to_their_vocab_ids(vocab):
    """Bit j of word w allows vocab id 32 w + j (the sign bit too), cut at the vocab's end."""
    gen = torch.Generator().manual_seed(vocab)
    words = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    want = [[bool((int(words[r, i // 32]) >> (i % 32)) & 1) for i in range(vocab)] for r in range(3)]
    assert allowed_tokens(words, vocab).tolist() == want


def reference_logprobs(runner, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The model's log-softmax before each generated token, as the engine's calls compute it."""
    kv = runner.new_sequence(len(prompt) + len(tokens) + 1)
    logits = runner.prefill(kv, torch.tensor(prompt), whole_prompt=True)
    out = []
    for t in tokens:
        out.append(torch.log_softmax(logits.float().reshape(-1), -1))
        logits = runner.decode([kv], torch.tensor([t]))[0]
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_logprobs_are_the_models_log_softmax(loaded, temperature):
    runner, tok, _ = loaded
    prompt = tok.encode("Logprobs, please:")
    params = SamplingParams(max_tokens=8, temperature=temperature, top_k=40, seed=2, ignore_eos=True, logprobs=5,
                            presence_penalty=0.5)  # sampling's own changes do not enter the numbers
    (out,) = run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)), [(prompt, params)])
    tokens = tokens_of(out)
    entries = [e for o in out for e in (o.logprobs or [])]
    assert [e.token for e in entries] == tokens and len(tokens) == 8
    for e, ref in zip(entries, reference_logprobs(runner, prompt, tokens), strict=True):
        assert abs(e.logprob - float(ref[e.token])) < 1e-5
        assert len(e.top) == 5 and [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
        top_ids = [t for t, _ in e.top]
        assert top_ids == ref.topk(5).indices.tolist()
        assert all(abs(lp - float(ref[t])) < 1e-5 for t, lp in e.top)
        if temperature == 0:
            assert top_ids[0] == e.token
    plain = SamplingParams(max_tokens=3, temperature=0)
    (none,) = run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)), [(prompt, plain)])
    assert all(o.logprobs is None for o in none)


def test_logit_bias_raises_and_bans(loaded):
    runner, tok, _ = loaded
    prompt = tok.encode("Bias:")
    (base,) = run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)),
                      [(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))])
    favourite = tok.tokens.index("Ġthe") if "Ġthe" in tok.tokens else 300
    (raised,) = run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)), [
        (prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=((favourite, 100.0),)))])
    assert tokens_of(raised) == [favourite] * 6
    banned = tuple((t, float("-inf")) for t in set(tokens_of(base)))
    (avoided,) = run_all(Engine(runner, tok, EngineConfig(prefix_cache=False)), [
        (prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias=banned))])
    assert not set(tokens_of(avoided)) & set(tokens_of(base))


def test_submit_refuses_a_grammar_of_another_vocab_and_biases_out_of_range(loaded):
    runner, tok, compiler = loaded
    engine = Engine(runner, tok, EngineConfig(prefix_cache=False))
    other = GrammarCompiler(tok, compiler.vocab_size + 64).compile('start: "x"\n')
    with pytest.raises(ValueError, match="compiled for"):
        engine.submit([1, 2], SamplingParams(max_tokens=2, grammar=other), lambda o: None)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.submit([1, 2], SamplingParams(max_tokens=2, logit_bias=((compiler.vocab_size, 1.0),)), lambda o: None)
