"""--layer-split on the CPU: two or three emulated stages against one stage."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from strata_mgpu.cli import main
from strata_mgpu.config import AUTO_SPLIT, EngineConfig, LayerSplit
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.split.runner import SplitError, build_split, plan_layers
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from strata_mgpu.tools.server_decode import bench_prompts
from tests.test_engine import greedy_chain, run_all

CPU = StageOptions(device=torch.device("cpu"), chunk_size=64)


@pytest.mark.parametrize("split, budgets, expected", [
    ("24", [None, None], [(0, 24), (24, 48)]),
    ("16,32", [None] * 3, [(0, 16), (16, 32), (32, 48)]),
    ("auto", [None, None], [(0, 24), (24, 48)]),
    ("auto", [16, 8], [(0, 32), (32, 48)]),
    ("auto", [1, 100], [(0, 1), (1, 48)]),
])
def test_plan_layers(split, budgets, expected):
    assert [(r.start, r.stop) for r in plan_layers(48, len(budgets), LayerSplit.parse(split), budgets)] == expected


@pytest.mark.parametrize("split, n, message", [
    ("48", 2, "must increase within 1..47"),
    ("24", 3, "makes 2 stages, but 3"),
])
def test_plan_layers_errors(split, n, message):
    with pytest.raises(SplitError, match=message):
        plan_layers(48, n, LayerSplit.parse(split), [None] * n)


@pytest.mark.parametrize("split, message", [
    ("24,12", "increasing from 1"),
    ("0", "increasing from 1"),
    ("x", "expected 'auto'"),
    ("", "expected 'auto'"),
])
def test_layer_split_parse_errors(split, message):
    with pytest.raises(ValueError, match=message):
        LayerSplit.parse(split)


@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return f, spec_from_gguf(f)


@pytest.mark.parametrize("layer_split, n_stages", [("2", 2), ("1,3", 3)])
def test_split_equals_single_stage_bit_for_bit(loaded, layer_split, n_stages):
    """Same kernels on the same rows: the hand-over must not change a single bit."""
    f, spec = loaded
    single = build_stage(f, spec, CPU)
    split = build_split(f, spec, [CPU] * n_stages, LayerSplit.parse(layer_split))
    assert [s.layers.start for s in split.stages][1:] == [int(x) for x in layer_split.split(",")]
    a_kv, b_kv = single.new_sequence(300), split.new_sequence(300)
    prompt = torch.randint(0, spec.vocab_size, (150,))
    for start in range(0, 150, 64):  # chunked, as the engine prefills
        a = single.prefill(a_kv, prompt[start:start + 64])
        b = split.prefill(b_kv, prompt[start:start + 64])
    assert torch.equal(a, b)
    other_a, other_b = single.new_sequence(300), split.new_sequence(300)
    single.prefill(other_a, prompt[:20])
    split.prefill(other_b, prompt[:20])
    for _ in range(3):  # two sequences decoded in one batch
        tokens = torch.tensor([int(a.argmax()), 7])
        a = single.decode([a_kv, other_a], tokens)
        b = split.decode([b_kv, other_b], tokens)
        assert torch.equal(a, b)
        a = a[0]
    assert all(x.bytes_moved > 0 for x in split.exchanges)


def test_a_stage_takes_rows_of_another_dtype_in_its_own(loaded):
    """`--devices cpu,0`: the CPU stage computes in fp32 and the card's in bf16; the second stage
    takes the first's fp32 rows in bf16 (its GEMMs refused mixed dtypes on the first prompt). Two
    CPU stages stand in: fp32, then bf16, prefill and decode as the bf16 stage alone would. Held
    bit for bit to the two halves run by hand, each a stage of its own: an fp32 stage's layers
    0-1, its rows rounded to bf16, a bf16 stage's layers 2-3 (the hand-over adds nothing but that
    rounding). Not to one stage within a tolerance: against one fp32 (or bf16) stage, the other
    half's rounding flips a near-tied expert pick on the tiny model for about one random prompt
    in fifty, which moves the logits far past bf16's 2e-2 (test_gpu's BF16_TOL)."""
    f, spec = loaded
    options = [CPU, replace(CPU, dtype=torch.bfloat16)]
    split = build_split(f, spec, options, LayerSplit((2,)))
    assert [s.model.w.dtype for s in split.stages] == [torch.float32, torch.bfloat16]
    halves = [range(0, 2), range(2, spec.n_layers)]
    assert [s.layers for s in split.stages] == halves
    alone = [build_stage(f, spec, o, r) for o, r in zip(options, halves, strict=True)]
    kv, parts = split.new_sequence(64), [s.new_sequence(64) for s in alone]
    prompt = torch.randint(0, spec.vocab_size, (20,))
    logits = split.prefill(kv, prompt)
    with torch.inference_mode():
        x = alone[0].model.run(alone[0].model.embed(prompt), [Segment(0, 20, parts[0])])  # [20, D] fp32
        x = alone[1].model.run(x.to(torch.bfloat16), [Segment(0, 20, parts[1])])
        want = alone[1].model.logits(x[-1:])[0]  # [V] bf16
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, want)
    for _ in range(2):
        token = logits.argmax(-1).reshape(1)
        logits = split.decode([kv], token)[0]
        with torch.inference_mode():
            x = token
            for k, (stage, part) in enumerate(zip(alone, parts, strict=True)):
                stage.refill_cache([part])
                x = stage.decode_rows([part], x.to(torch.bfloat16) if k else x)  # [1, D], then [1, V]
        assert torch.equal(logits, x[0])
    assert torch.isfinite(logits.float()).all() and kv.length == 22


def test_split_packs_short_prompts_like_one_stage(loaded):
    """Several prompts in one pass through the stages (segments): each one's last logits as one
    stage gives them, and their decode goes on alike."""
    f, spec = loaded
    single, split = build_stage(f, spec, CPU), build_split(f, spec, [CPU, CPU], LayerSplit((2,)))
    prompts = [torch.randint(0, spec.vocab_size, (n,)) for n in (5, 17, 9)]
    a_kvs, b_kvs = [single.new_sequence(64) for _ in prompts], [split.new_sequence(64) for _ in prompts]
    a, b = single.prefill_many(a_kvs, prompts), split.prefill_many(b_kvs, prompts)
    assert a.shape == b.shape == (3, spec.vocab_size) and torch.equal(a, b)
    assert [kv.length for kv in b_kvs] == [5, 17, 9]
    tokens = a.argmax(-1)
    assert torch.equal(single.decode(a_kvs, tokens), split.decode(b_kvs, tokens))


def test_engine_packs_short_prompts_on_a_split(loaded):
    """Arrivals together reach their first token in one call on a split too (it has
    prefill_many), and their greedy tokens are those of one stage."""
    f, spec = loaded
    tok = tokenizer_from_gguf(f)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [(tok.encode(t), params) for t in ("One fish.", "Two fish, red fish.", "Blue fish.")]
    split, single = build_split(f, spec, [CPU, CPU], LayerSplit((2,))), build_stage(f, spec, CPU)
    calls = []
    real = split.prefill_many
    split.prefill_many = lambda kvs, chunks: calls.append(len(chunks)) or real(kvs, chunks)
    outs = run_all(Engine(split, tok, EngineConfig(chunk_size=64)), prompts)
    ref = run_all(Engine(single, tok, EngineConfig(chunk_size=64)), prompts)
    assert calls and max(calls) >= 2
    assert [[t for o in out for t in o.token_ids] for out in outs] == [[t for o in r for t in o.token_ids] for r in ref]


def test_engine_greedy_on_split_equals_reference(loaded, tiny_gguf):
    f, spec = loaded
    tok = tokenizer_from_gguf(f)
    from strata_mgpu.model.runner import load_reference_runner

    split = build_split(f, spec, [CPU, CPU], AUTO_SPLIT)
    assert split.warm_decode_graphs(4096) == []  # CPU stages replay no graphs: nothing captured ahead
    prompt = tok.encode("The sea is wide, the sea is deep.")
    (out,) = run_all(Engine(split, tok, EngineConfig(chunk_size=5)),
                     [(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))])
    assert [t for o in out for t in o.token_ids] == greedy_chain(load_reference_runner(f, spec), prompt, 10)


SERVED, SERVED_TOKENS = 6, 48  # requests served together, tokens each


def served_ids(runner, tok, config: EngineConfig) -> list[list[int]]:
    """The token ids of SERVED requests decoded together on the engine's own thread, its decode graphs
    captured first (`Engine.start`), as `strata bench --server-decode` sends them: corpus prompts, each
    request seeded, EOS ignored; half of them top-p, the last greedy. All are submitted before the
    engine starts, so every run batches them alike. Each must end at its length, with no error."""
    params = [SamplingParams(max_tokens=SERVED_TOKENS, temperature=0.8, top_p=0.9 if i % 2 else 1.0, seed=i,
                             ignore_eos=True) for i in range(SERVED - 1)]
    params.append(SamplingParams(max_tokens=SERVED_TOKENS, temperature=0, ignore_eos=True))
    outs: list[list[RequestOutput]] = [[] for _ in params]
    finished = threading.Semaphore(0)

    def collect(out: list[RequestOutput]) -> Callable[[RequestOutput], None]:
        def on_output(o: RequestOutput) -> None:  # on the engine's thread
            out.append(o)
            if o.finished:
                finished.release()
        return on_output

    engine = Engine(runner, tok, config)
    for prompt, p, out in zip(bench_prompts(tok, SERVED, 16), params, outs, strict=True):
        engine.submit(prompt, p, collect(out))
    engine.start()
    try:
        assert all(finished.acquire(timeout=120) for _ in outs), "the engine did not finish"
    finally:
        engine.shutdown()
    for out in outs:
        assert (out[-1].finish_reason, out[-1].n_generated) == ("length", SERVED_TOKENS), out[-1].error
    return [[t for o in out for t in o.token_ids] for out in outs]


def test_server_shaped_sampled_decode_on_a_split_equals_one_stage(loaded):
    """The flow of the GPU race test (tests/test_gpu_split_engine.py) on CPU stages, where the split
    is bit-exact: sampled requests decoded together on the engine's thread draw one stage's tokens."""
    f, spec = loaded
    tok, config = tokenizer_from_gguf(f), EngineConfig(ctx_size=256, chunk_size=64)
    want = served_ids(build_stage(f, spec, CPU), tok, config)
    assert served_ids(build_split(f, spec, [CPU, CPU], LayerSplit((2,))), tok, config) == want


def test_bench_cli_with_two_cpu_stages(tiny_gguf, tmp_path):
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--devices", "cpu,cpu", "--prompt-tokens", "64,300",
                                  "--chunk-size", "128", "--decode-tokens", "4", "--runs", "1"])
    assert r.exit_code == 0, r.output
    assert "stage 0: layers 0-1 on cpu" in r.output and "stage 1: layers 2-3 on cpu" in r.output
    assert "stages busy at the same time" in r.output
    assert "25% resident" in r.output and "memory plan (host RAM): dense weights" in r.output  # a quarter
    assert "VRAM" not in r.output and "n/a" not in r.output and "pinned H2D" not in r.output  # no GPU, no link
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--devices", "cpu", "--prompt-tokens", "64",
                                  "--decode-tokens", "2", "--runs", "1", "--resident-experts", "0", "--json",
                                  str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "b.json").read_text())
    stage = result["stages"][0]
    assert stage["resident_share"] == 0 and stage["pass_bytes"] == stage["expert_bytes"]  # residency forced off
    assert result["prefill"][0]["streamed_bytes"] == stage["expert_bytes"] and result["prefill"][0]["compute_s"] > 0
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--devices", "cpu,cpu", "--layer-split", "9"])
    assert r.exit_code == 1 and "must increase" in r.output
    assert "ignored on the CPU" not in r.output  # no --max-vram given


def test_bench_and_sweep_say_max_vram_is_ignored_on_the_cpu(tiny_gguf):
    for args in (["bench", "--prompt-tokens", "32", "--decode-tokens", "0", "--runs", "1"],
                 ["sweep", "--prompt-tokens", "32", "--shares", "0.3", "--runs", "1"]):
        r = CliRunner().invoke(main, [args[0], str(tiny_gguf), "--devices", "cpu,cpu", "--max-vram", "4,4", *args[1:]])
        assert r.exit_code == 0, r.output
        assert "warning: --max-vram 4,4 is ignored on the CPU: it caps GPU memory only" in r.output


def test_server_on_two_cpu_stages_answers_like_the_reference(tiny_gguf, tmp_path):
    """Through HTTP: the split runner behind the engine gives the fp32 reference's greedy text, in
    one prompt chunk and in several. (Against one `--devices cpu` stage it may not: that stage's
    experts and projections are ggml's, its activations rounded to 8 bits, where a split's CPU
    stages run the device path's fp32 twins.)"""
    import httpx

    from strata_mgpu.model.runner import load_reference_runner
    from tests.engine_runs import run_one
    from tests.server_proc import running_server

    f = GGUFFile(tiny_gguf)
    tok = tokenizer_from_gguf(f)
    prompt = tok.encode("Tell me about the sea.")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = "".join(o.text for o in run_one(Engine(load_reference_runner(f, spec_from_gguf(f)), tok, EngineConfig()),
                                           prompt, params))
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    for chunk in ("8192", "8"):
        args = ["--devices", "cpu,cpu", "--layer-split", "2", "--chunk-size", chunk]
        with running_server([str(tiny_gguf), *args], tmp_path / f"{chunk}.log") as base:
            r = httpx.post(base + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want, chunk
