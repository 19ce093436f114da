"""The split's per-stage threads (`split.workers`), on CPU stages forced threaded: results equal
the inline run, chunks not waited for still land in order, and a stage's failure reaches the
prompt it belongs to while every stage stays in step for the next call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from strata_mgpu.config import LayerSplit
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.split.runner import build_split
from strata_mgpu.split.workers import StageWorkers
from strata_mgpu.stage.stage import StageOptions

CPU = StageOptions(device=torch.device("cpu"), chunk_size=64)
# fp32 on the CPU: a worker thread's matmuls may split their sums differently from the main
# thread's (its own OpenMP team), so threaded and inline agree to rounding, not bit for bit
TOL = 1e-5


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOL * float(b.abs().max())


@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return f, spec_from_gguf(f)


def threaded_split(f, spec, n_stages: int = 2):
    split = build_split(f, spec, [CPU] * n_stages, LayerSplit((2,)) if n_stages == 2 else LayerSplit((1, 3)))
    split.workers = StageWorkers([s.ctx for s in split.stages], threaded=True)
    return split


def prefill_chunks(runner, kv, prompt: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    out = None
    for start in range(0, prompt.numel(), chunk):
        last = start + chunk >= prompt.numel()
        out = runner.prefill(kv, prompt[start:start + chunk], want_logits=last)
        assert (out is None) != last
    return out


@pytest.mark.parametrize("n_stages", [2, 3])
def test_threaded_stages_equal_inline(loaded, n_stages):
    f, spec = loaded
    inline = build_split(f, spec, [CPU] * n_stages, LayerSplit((2,)) if n_stages == 2 else LayerSplit((1, 3)))
    assert not inline.workers.threaded  # CPU stages run as they are queued
    threaded = threaded_split(f, spec, n_stages)
    prompt = torch.randint(0, spec.vocab_size, (200,))
    a_kv, b_kv = inline.new_sequence(300), threaded.new_sequence(300)
    a = prefill_chunks(inline, a_kv, prompt)
    b = prefill_chunks(threaded, b_kv, prompt)
    assert close(a, b) and not b_kv.pending
    for _ in range(3):
        token = torch.tensor([int(a.argmax())])
        a, b = inline.decode([a_kv], token)[0], threaded.decode([b_kv], token)[0]
        assert close(a, b)


def test_each_stage_queues_on_its_own_thread(loaded):
    f, spec = loaded
    split = threaded_split(f, spec)
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    split.on_stage = lambda k, what: seen[k].add(threading.current_thread().name)
    prefill_chunks(split, split.new_sequence(300), torch.randint(0, spec.vocab_size, (150,)))
    assert all(len(names) == 1 for names in seen.values())
    assert seen[0] != seen[1] and threading.current_thread().name not in seen[0] | seen[1]


def test_a_stage_failure_reaches_its_prompt_and_the_stages_stay_in_step(loaded, monkeypatch):
    """Stage 1 fails on the second chunk, which nobody waits for: the prompt's last chunk raises
    that error; the next prompt runs as if nothing happened (the exchange's sends and receives
    still pair up)."""
    f, spec = loaded
    split = threaded_split(f, spec)
    reference = build_split(f, spec, [CPU] * 2, LayerSplit((2,)))
    stage1 = split.stages[1].model
    real_run, calls = stage1.run, []

    def flaky_run(x, segments):
        calls.append(x.shape[0])
        if len(calls) == 2:
            raise RuntimeError("stage 1 ran out of something")
        return real_run(x, segments)

    monkeypatch.setattr(stage1, "run", flaky_run)
    prompt = torch.randint(0, spec.vocab_size, (200,))
    with pytest.raises(RuntimeError, match="stage 1 ran out of something"):
        prefill_chunks(split, split.new_sequence(300), prompt)
    assert len(calls) == 4  # the later chunks were still queued and run: the failure stays with its prompt
    kv, ref_kv = split.new_sequence(300), reference.new_sequence(300)
    assert close(prefill_chunks(split, kv, prompt), prefill_chunks(reference, ref_kv, prompt))


def test_a_stage0_failure_skips_the_later_stages_of_that_chunk(loaded, monkeypatch):
    f, spec = loaded
    split = threaded_split(f, spec)
    stage0, stage1 = split.stages[0].model, split.stages[1].model
    real0, real1, calls1 = stage0.run, stage1.run, []
    monkeypatch.setattr(stage0, "run", lambda x, segs: (_ for _ in ()).throw(MemoryError("stage 0 out")))
    monkeypatch.setattr(stage1, "run", lambda x, segs: calls1.append(1) or real1(x, segs))
    with pytest.raises(MemoryError, match="stage 0 out"):
        split.prefill(split.new_sequence(100), torch.arange(10))
    assert not calls1  # stage 1 raised its upstream's error without receiving anything
    monkeypatch.setattr(stage0, "run", real0)
    out = split.prefill(split.new_sequence(100), torch.arange(10))
    assert out.shape == (spec.vocab_size,) and calls1 == [1]


def test_a_pack_waits_for_its_first_prompts_chunks_in_flight(loaded):
    """The engine packs the next chunk of a long prompt (its earlier chunks maybe still queued)
    with short prompts: the pack's result waits for those too, and equals the inline run's."""
    f, spec = loaded
    split, reference = threaded_split(f, spec), build_split(f, spec, [CPU] * 2, LayerSplit((2,)))
    long = torch.randint(0, spec.vocab_size, (114,))  # 64, then 50 beside 5 + 9: one chunk's room
    shorts = [torch.randint(0, spec.vocab_size, (n,)) for n in (5, 9)]
    outs = []
    for runner in (split, reference):
        kv = runner.new_sequence(300)
        assert runner.prefill(kv, long[:64], want_logits=False) is None or runner is reference
        others = [runner.new_sequence(64) for _ in shorts]
        outs.append(runner.prefill_many([kv, *others], [long[64:], *shorts]))
        assert not kv.pending and [o.length for o in others] == [5, 9] and kv.length == 114
    assert outs[0].shape == (3, spec.vocab_size) and close(*outs)


def test_a_bounded_exchange_never_overwrites_rows_not_yet_read():
    """Writer and reader on two threads, the reader slow: with two buffers the writer's third
    send waits until the first rows were taken (on the CPU the copy happens at once, so an
    overwrite would show as wrong rows)."""
    from strata_mgpu.kernels.experts import TorchKernels
    from strata_mgpu.split.exchange import Exchange
    from strata_mgpu.stage.device import DeviceContext

    cpu = DeviceContext(torch.device("cpu"))
    ex = Exchange(cpu, cpu, TorchKernels(), TorchKernels(), max_bytes=64 * 4, bounded=True)
    sent = [torch.full((4, 16), float(i)) for i in range(6)]
    got = []

    def reader():
        for _ in sent:
            time.sleep(0.02)
            got.append(ex.receive())

    t = threading.Thread(target=reader)
    t.start()
    for x in sent:
        ex.send(x)
    t.join()
    assert all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))


def test_a_lagging_stage_reads_every_chunk_it_was_sent(loaded):
    """Stage 1 slowed on the host while stage 0's thread runs ahead through a long prompt's
    chunks: the result is still the inline run's (before the bound, stage 0 wrote chunk c+2 into
    chunk c's buffer before stage 1 read it: other logits, another argmax)."""
    f, spec = loaded
    split, reference = threaded_split(f, spec), build_split(f, spec, [CPU] * 2, LayerSplit((2,)))
    split.on_stage = lambda k, what: time.sleep(0.05) if (k, what) == (1, "end") else None
    prompt = torch.randint(0, spec.vocab_size, (320,))
    a = prefill_chunks(split, split.new_sequence(400), prompt)
    b = prefill_chunks(reference, reference.new_sequence(400), prompt)
    assert close(a, b)
