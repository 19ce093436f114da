"""Where a few-row pass gathers its picked experts instead of streaming whole layers
(stage.experts.break_even): the rule from measured rates, and the two paths' answers equal on a
CPU stage's twins."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.config import StageSwitches
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.break_even import PassRates, gather_rows
from strata_mgpu.stage.stage import StageOptions

CPU = torch.device("cpu")
MB = 2**20
# one 30B-A3B layer at --max-vram 16: 128 experts, 86 resident, 8 picks a row, ~3 MB an expert
LAYER = dict(n_experts=128, n_used=8, missing=42, expert_bytes=3.06 * MB)


def test_the_break_even_follows_the_rates_and_the_hit_rate():
    link = 55e9
    fast = PassRates(link, mapped_bytes_per_s=link)
    slow = PassRates(link, mapped_bytes_per_s=link / 2)
    uniform = 42 / 128
    # mapped reads as fast as DMA and misses as uniform as the residency: near E / A rows, less the
    # picks' compute
    assert 14 <= fast.break_even_rows(**LAYER, miss_share=uniform) <= 16
    assert slow.break_even_rows(**LAYER, miss_share=uniform) < fast.break_even_rows(**LAYER, miss_share=uniform)
    # residency that follows the routing misses less: more rows gather
    assert fast.break_even_rows(**LAYER, miss_share=0.06) > 3 * fast.break_even_rows(**LAYER, miss_share=uniform)
    assert fast.break_even_rows(**LAYER, miss_share=0.0) == pytest.approx(
        42 * 3.06 * MB / link / (8 * fast.pick_s))  # only the picks' compute left
    assert fast.break_even_rows(**{**LAYER, "missing": 0}, miss_share=0.0) == float("inf")


def test_the_limit_keeps_decode_batches_gathering_and_the_kernels_bounds():
    slow = PassRates(55e9, mapped_bytes_per_s=5e9)
    even = slow.break_even_rows(**LAYER, miss_share=42 / 128)
    assert even < 8
    assert gather_rows(slow, **LAYER, miss_share=42 / 128, floor_rows=8, cap_rows=64) == 8  # the graphs' batches
    assert gather_rows(slow, **LAYER, miss_share=0.0, floor_rows=8, cap_rows=64) == 64  # the kernels' most
    assert gather_rows(None, **LAYER, miss_share=0.5, floor_rows=8, cap_rows=64) == 16  # unmeasured: E picks
    fast = PassRates(55e9, mapped_bytes_per_s=55e9)
    want = fast.break_even_rows(**LAYER, miss_share=0.2)
    assert gather_rows(fast, **LAYER, miss_share=0.2, floor_rows=1, cap_rows=64) == int(-(-want // 1))
    with pytest.raises(ValueError, match="positive"):
        PassRates(0.0, 1.0)


def test_a_few_row_prompt_gathers_below_the_break_even_and_answers_as_streaming(tiny_gguf):
    """With rates whose break-even is 3 rows, a 2-row prompt gathers its picks (decode's path: the
    twins' gathered kernel) and a 3-row one streams; the 2-row prompt streamed (the rule told to
    stream from 1 row) gives the same logits in fp32 within 1e-5 of their scale."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2)))
    experts, paths = stage.experts, stage.kernels.paths
    A, missing = spec.n_experts_used, spec.n_experts - 2
    b = experts._expert_bytes
    miss = 1 - stage.experts.cache.expected_hit
    # mapped reads such that streaming a layer costs what 2.5 gathered rows do: 3 rows stream
    link = 1e9
    per_row_s = missing * b / link / 2.5
    mapped = A * miss * b / (per_row_s - A * 1e-9)
    experts.set_gather_rule(PassRates(link, mapped, pick_s=1e-9, expert_s=0.0), floor_rows=1)
    assert experts.stream_rows() == 3 and not experts.should_stream(2) and experts.should_stream(3)
    assert experts.gather_picks == 3 * A
    prompt = torch.randint(0, spec.vocab_size, (2,), generator=torch.Generator().manual_seed(3))

    before = dict(paths)
    gathered = stage.prefill(stage.new_sequence(8), prompt)
    assert paths["moe_gathered:twin"] - before.get("moe_gathered:twin", 0) == spec.n_layers
    assert paths.get("grouped_mlp:loop", 0) - before.get("grouped_mlp:loop", 0) == spec.n_layers  # the twin's own

    experts.set_gather_rule(None, floor_rows=1, fixed_rows=1)  # every pass streams
    assert experts.should_stream(1)
    before = dict(paths)
    streamed = stage.prefill(stage.new_sequence(8), prompt)
    assert paths.get("moe_gathered:twin", 0) == before.get("moe_gathered:twin", 0)
    assert (streamed - gathered).abs().max() <= 1e-5 * streamed.abs().max()
    assert torch.equal(streamed.argmax(), gathered.argmax())


def test_an_all_resident_or_cacheless_stage_keeps_its_limits(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    full = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=spec.n_experts)))
    none = build_stage(f, spec, StageOptions(device=CPU, expert_cache=False))
    assert not full.experts.partly_resident and full.experts.gather_picks == spec.n_experts
    assert none.experts.stream_rows() == 0 and none.experts.should_stream(1)
    fixed = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2, gather_rows=3)))
    assert fixed.experts.stream_rows() == 3
    capped = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2,
                                                                                  gather_rows=1000)))
    assert capped.experts.stream_rows() == -(-spec.n_experts // spec.n_experts_used)  # the twins' workspace


def test_warm_prompts_run_both_paths_and_leave_no_trace(tiny_gguf):
    """The start's warm prompts (a GPU stage runs them before capturing its graphs): the most rows that
    gather and the fewest that stream, each once; its sequences and caches untouched."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2)))
    limit = stage.experts.stream_rows()
    before = dict(stage.kernels.paths)
    assert stage.warm_prompts() == [limit - 1, limit]
    after = stage.kernels.paths
    assert after["moe_gathered:twin"] - before.get("moe_gathered:twin", 0) == spec.n_layers
    assert stage.experts.ring is not None and stage.experts.ring.uploaded_bytes == stage.experts.pass_bytes()
