"""GPU checks of the engine's device side (marker `gpu`; skipped without CUDA): the batch sampler
on CUDA equals it on the CPU and never waits for the device; the pipelined engine over a Stage
gives the tokens of a hand-run loop; packed prefill on a Stage; the server-shaped measurement."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.config import EngineConfig, StageSwitches
from strata_mgpu.engine.device_sampler import BatchSampler
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import Stage, StageOptions
from strata_mgpu.tools.server_decode import measure_server_decode
from tests.engine_runs import run_all
from tests.test_gpu import BF16_Q8_TOL, stage_on_its_own_budget

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
BF16_TOL = 2e-2  # max|diff| / max|ref|, as in test_gpu.py

MIXED = [SamplingParams(max_tokens=99, temperature=0),
         SamplingParams(max_tokens=99, temperature=0.8, seed=1),
         SamplingParams(max_tokens=99, temperature=0.7, top_p=0.9, seed=2),
         SamplingParams(max_tokens=99, temperature=1.1, top_k=40, seed=3),
         SamplingParams(max_tokens=99, temperature=1.0, min_p=0.05, seed=4),
         SamplingParams(max_tokens=99, temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, presence_penalty=0.5,
                        frequency_penalty=0.3, seed=5),
         SamplingParams(max_tokens=99, temperature=0, frequency_penalty=1.0)]


@pytest.fixture(scope="module")
def stage_and_tok(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return build_stage(f, spec_from_gguf(f), StageOptions(device=CUDA, max_vram_gib=8)), tokenizer_from_gguf(f)


def test_sampler_on_cuda_equals_on_cpu_at_full_vocab():
    """Same keys, same filters: the CUDA draws are the CPU draws (float rounding could flip a
    near-tie; at these sizes that is far rarer than one in the 7 x 6 draws here)."""
    g = torch.Generator().manual_seed(0)
    on_cpu, on_cuda = BatchSampler(), BatchSampler()
    cpu_states = [on_cpu.open(p) for p in MIXED]
    cuda_states = [on_cuda.open(p) for p in MIXED]
    for _ in range(6):
        logits = torch.randn(len(MIXED), 151_936, generator=g) * 3
        want = on_cpu.sample(logits, cpu_states)
        got = on_cuda.sample(logits.to(CUDA), cuda_states)
        assert got.device.type == "cuda"
        assert got.cpu().tolist() == want.tolist()


def test_sampling_never_waits_for_the_device():
    sampler = BatchSampler()
    states = [sampler.open(p) for p in MIXED]
    logits = torch.randn(len(MIXED), 151_936, device=CUDA)
    sampler.sample(logits, states)  # first call: tables, pinned blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            tokens = sampler.sample(logits, states)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (len(MIXED),)


@pytest.fixture(scope="module")
def stage_of_bf16_projections(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    options = StageOptions(device=CUDA, max_vram_gib=8, switches=StageSwitches(dense_blocks=False))
    return build_stage(f, spec_from_gguf(f), options)


def prefill_many_against_one_at_a_time(stage: Stage) -> float:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, stage.spec.vocab_size, (n,), generator=g) for n in (9, 2, 17)]
    one = torch.stack([stage.prefill(stage.new_sequence(64), p) for p in prompts])
    many = stage.prefill_many([stage.new_sequence(64) for _ in prompts], prompts)
    return float((many.float() - one.float()).abs().max() / one.float().abs().max())


def test_prefill_many_on_a_stage_equals_one_at_a_time(stage_and_tok, stage_of_bf16_projections):
    """The packed prompts against each alone. With bf16 projections both sides multiply alike: only
    the packing differs (BF16_TOL). With the file's blocks (the default), the 2-token prompt alone
    takes dense_q8 (at most DENSE_MAX_ROWS rows: 8-bit activations) where the 28 packed rows take
    the bf16 GEMM, so the two differ by that quantization too (BF16_Q8_TOL, as decode's)."""
    assert prefill_many_against_one_at_a_time(stage_of_bf16_projections) < BF16_TOL
    assert prefill_many_against_one_at_a_time(stage_and_tok[0]) < BF16_Q8_TOL


def hand_run(stage: Stage, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of one sequence, each step's logits to the host: the engine's old loop."""
    kv = stage.new_sequence(256)
    chain = [int(stage.prefill(kv, torch.tensor(prompt)).argmax())]
    while len(chain) < n:
        chain.append(int(stage.decode([kv], torch.tensor(chain[-1:]))[0].argmax()))
    return chain


def test_pipelined_engine_on_a_stage_equals_the_hand_run_loop(stage_and_tok):
    """Batch 1 (the captured-graph path), one request after another: the device-fed, one-step-late
    engine gives the tokens and text of the loop that synced on every step's logits."""
    stage, tok = stage_and_tok
    prompts = [tok.encode("The sea is wide"), tok.encode("def f(x):")]
    engine = Engine(stage, tok, EngineConfig(ctx_size=256, max_running=1))
    outs = run_all(engine, [(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for p in prompts])
    for prompt, out in zip(prompts, outs, strict=True):
        got = [t for o in out for t in o.token_ids]
        assert got == hand_run(stage, prompt, 12)
        assert "".join(o.text for o in out) == tok.decode(got) and out[-1].finish_reason == "length"


def test_seeded_requests_repeat_on_a_stage(stage_and_tok):
    stage, tok = stage_and_tok
    p = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    runs = [run_all(Engine(stage, tok, EngineConfig(ctx_size=256)), [(tok.encode("Once"), p)])[0] for _ in range(2)]
    assert [[t for o in out for t in o.token_ids] for out in runs][0] == [t for o in runs[1] for t in o.token_ids]


def test_a_decode_step_launches_without_waiting(stage_and_tok):
    """Past its first steps, a batch-1 request's step (graph replay, draw, copy to the host) queues
    on the device with no host sync: the host's text work overlaps the device's step."""
    stage, tok = stage_and_tok
    engine = Engine(stage, tok, EngineConfig(ctx_size=256))
    out: list[RequestOutput] = []
    engine.submit(tok.encode("Hello"), SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True),
                  out.append)
    for _ in range(4):  # prefill, the cache's refill, the graph's capture
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = engine._launch(engine.scheduler.plan())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert launched is not None and launched.n_decode_rows == 1
    assert not any(o.finish_reason == "error" for o in out)
    engine._in_flight, previous = launched, engine._in_flight
    engine._land(previous)
    while not (out and out[-1].finished):
        engine.step()
    assert out[-1].n_generated == 40 and out[-1].finish_reason == "length"


def test_server_decode_measurement_on_a_stage(stage_and_tok):
    stage, tok = stage_and_tok
    report = measure_server_decode(stage, tok, n_requests=4, max_tokens=24, prompt_tokens=16,
                                   config=EngineConfig(ctx_size=256, max_running=4))
    assert report.n_generated == 4 * 24 and all(r.decode_tok_per_s for r in report.requests)
    print(report.summary())


def test_a_whole_context_prompt_through_the_server_with_its_kv_mostly_in_host_ram(tmp_path):
    """#12 at the `small` preset's scale: a stage that keeps 1,024 KV cells in VRAM serves, through
    the HTTP app, a prompt of nearly the model's whole context (8,192): its older KV in pinned host
    RAM, uploaded ahead of each attention layer. 200 with every token; then a prompt past the
    context is a 400 naming the limit, and a short request still runs."""
    from fastapi.testclient import TestClient

    from strata_mgpu.model.synthetic import write_model
    from strata_mgpu.server.app import ServerState, create_app

    path = tmp_path / "small.gguf"
    write_model(path, "small", seed=2)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    stage, base = stage_on_its_own_budget(f, spec, 2, kv_tokens=1024, context=spec.context_length, chunk_size=2048)
    assert stage.plan.kv_tokens == 1024 and stage.max_context == spec.context_length
    engine = Engine(stage, tokenizer_from_gguf(f), EngineConfig(ctx_size=spec.context_length, chunk_size=2048))
    engine.start()
    try:
        client = TestClient(create_app(ServerState(model_name="m", engine=engine)), raise_server_exceptions=False)
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(10, spec.vocab_size, (spec.context_length - 40,), generator=g).tolist()
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 16,
                                     "total_tokens": len(prompt) + 16,
                                     "prompt_tokens_details": {"cached_tokens": 0}}  # a spilled KV is not cached
        r = client.post("/v1/completions", json={"prompt": prompt + prompt[:100], "max_tokens": 16})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": prompt[:20], "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        engine.shutdown()
    assert torch.cuda.max_memory_reserved(CUDA) - base <= 2 * 2**30
