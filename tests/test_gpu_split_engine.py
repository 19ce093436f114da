"""The engine serving sampled requests on a split whose two stages share one card (`--devices 0,0`,
marker `gpu`; skipped without CUDA): the regression test of the race fixed in `SplitRunner._submit`.
A decode step's input is the previous step's tokens, drawn by the sampler on the engine's stream;
on the first stage's own card `tokens.to` copies nothing, so unless stage 0 waits for the draw it
reads the ids before they are written (half-drawn ids failed the embedding's index assert under
`strata bench --server-decode 1,8`; stale ones would decode wrong tokens without an error)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from strata_mgpu.config import EngineConfig, LayerSplit, StageSwitches
from strata_mgpu.engine.device_sampler import BatchSampler
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.split.runner import build_split
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.graphs.capture import DecodeGraph
from strata_mgpu.stage.stage import StageOptions
from tests.test_split import SERVED_TOKENS, served_ids

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
LAG_CYCLES = 10_000_000  # ~5 ms of spinning at an H200's ~2 GHz: longer than the host takes to launch a step
CONFIG = EngineConfig(ctx_size=256, chunk_size=128)  # every prompt in one pack: 47 decode steps of all rows


def lagging(sample):
    """BatchSampler.sample queued behind LAG_CYCLES of spinning on the engine's stream: the draws
    land well after the next step's first stage is launched, which then reads the ids before they
    are written unless it waits for them. A tiny model's step may be over before the host launches
    the next, which would hide the race; the real model's long steps do not."""
    def sample_late(self, logits, states):
        torch.cuda._sleep(LAG_CYCLES)
        return sample(self, logits, states)
    return sample_late


def test_sampled_requests_on_two_stages_of_one_card_draw_one_stages_tokens(tiny_gguf, monkeypatch):
    """Six requests (five sampled and seeded, one greedy) of 48 tokens, decoded together by the
    engine on its thread with the decode graphs captured at its start, as the server runs them:
    on two stages of cuda:0 they finish with no error and draw exactly the tokens one stage draws
    (a split is bit-identical to one stage: test_gpu's test_two_stages_equal_one_stage). Twice:
    as served, then with every draw lagging, where an unordered read is all but certain."""
    f = GGUFFile(tiny_gguf)
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    opts = StageOptions(device=CUDA, max_vram_gib=4, chunk_size=128, switches=StageSwitches(decode_graph_batch=8))
    want = served_ids(build_stage(f, spec, opts), tok, CONFIG)
    split = build_split(f, spec, [opts, opts], LayerSplit((2,)))
    assert [s.ctx.device for s in split.stages] == [CUDA, CUDA] and all(s.graphs.enabled for s in split.stages)
    replays = []
    step = DecodeGraph.step
    monkeypatch.setattr(DecodeGraph, "step", lambda graph, kvs, inp, linear=None:
                        replays.append(graph) or step(graph, kvs, inp, linear))
    for lag in (False, True):
        with monkeypatch.context() as m:
            if lag:
                m.setattr(BatchSampler, "sample", lagging(BatchSampler.sample))
            assert served_ids(split, tok, CONFIG) == want, f"lagging draws: {lag}"
    assert len(replays) == 2 * 2 * (SERVED_TOKENS - 1)  # every step a replay on each stage, in both runs


def test_server_shaped_decode_with_the_first_stage_on_the_cpu(tiny_gguf, monkeypatch):
    """`--devices cpu,0 --dtype fp32`: the first stage takes the device-drawn tokens after a host
    wait (the stream wait of the two-stage card raised there on every decode step). fp32 on both:
    a bf16 second stage cannot take the CPU stage's fp32 rows. The six requests finish with no
    error and draw exactly the tokens one fp32 stage on cuda:0 draws, as served and with every
    draw lagging (a first stage that read the ids before they are drawn would decode stale or
    half-written ones). Token for token although layers 0-1 run on the CPU: both sides are fp32
    without TF32, so their logits differ by summation order alone, and neither the greedy argmax
    nor a seeded draw (an exponential race on noise hashed from the seed, the same on every
    device) changes under that unless it sits that close to a tie or to top-p's cut; so
    test_gpu's test_greedy_decode_gpu_equals_cpu holds greedy CPU and cuda:0 fp32 to one chain."""
    f = GGUFFile(tiny_gguf)
    spec, tok = spec_from_gguf(f), tokenizer_from_gguf(f)
    fp32 = StageOptions(device=CUDA, max_vram_gib=4, chunk_size=128, dtype=torch.float32)
    want = served_ids(build_stage(f, spec, fp32), tok, CONFIG)
    split = build_split(f, spec, [replace(fp32, device=torch.device("cpu"), max_vram_gib=None), fp32],
                        LayerSplit((2,)))
    assert [s.ctx.device for s in split.stages] == [torch.device("cpu"), CUDA]
    assert [s.model.w.dtype for s in split.stages] == [torch.float32, torch.float32]
    for lag in (False, True):
        with monkeypatch.context() as m:
            if lag:
                m.setattr(BatchSampler, "sample", lagging(BatchSampler.sample))
            assert served_ids(split, tok, CONFIG) == want, f"lagging draws: {lag}"  # each ends at its length
