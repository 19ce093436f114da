"""The stage's VRAM plan: its arithmetic, that it never exceeds the budget, and its errors."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_mgpu.model.synthetic import PRESETS
from strata_mgpu.stage.memory_plan import (
    GiB,
    PlanError,
    activation_bytes,
    decode_bytes,
    kv_bytes,
    plan_memory,
    plan_stage_memory,
    workspace_bytes,
)

SPEC_30B = PRESETS["30b-a3b"].spec("")
EXPERT_30B = 391_600_000 // 128  # Q4_K gate/up + Q6_K down: about 3.06 MB an expert


def test_30b_at_16_gib_keeps_the_lines_and_fills_the_rest():
    plan = plan_memory(SPEC_30B, n_layers=48, expert_bytes=EXPERT_30B, dense=int(3.3e9), budget=16 * GiB,
                       chunk_tokens=8192, kv_tokens=8192)
    assert plan.workspace == 128 * 3 * 768 * 2048 * 2 and plan.kv == 48 * 8192 * 2 * 512 * 2
    assert plan.total <= plan.budget < plan.total + plan.n_layers * plan.expert_bytes  # one more would not fit
    assert 0.3 < plan.resident_share < 0.6
    assert plan.ring == 2 * (128 - plan.resident_per_layer) * EXPERT_30B
    assert [what for what, _ in plan.lines()][-3:] == ["total", "budget", "unplaced"]


def test_all_resident_drops_the_ring():
    plan = plan_memory(SPEC_30B, n_layers=48, expert_bytes=EXPERT_30B, dense=int(3.3e9), budget=40 * GiB,
                       chunk_tokens=8192, kv_tokens=40960)
    assert plan.resident_per_layer == 128 and plan.ring == 0 and plan.total <= 40 * GiB


def test_too_small_a_budget_is_one_line_naming_the_lines():
    with pytest.raises(PlanError) as e:
        plan_memory(SPEC_30B, n_layers=48, expert_bytes=EXPERT_30B, dense=int(3.3e9), budget=4 * GiB,
                    chunk_tokens=8192, kv_tokens=40960, where="stage on cuda:0")
    msg = str(e.value)
    assert "\n" not in msg and "stage on cuda:0" in msg and "dense weights" in msg and "KV pool" in msg
    with pytest.raises(PlanError, match="resident experts 200"):
        plan_memory(SPEC_30B, n_layers=48, expert_bytes=EXPERT_30B, dense=0, budget=40 * GiB, chunk_tokens=512,
                    kv_tokens=512, resident_per_layer=200)
    with pytest.raises(PlanError, match="over the"):
        plan_memory(SPEC_30B, n_layers=48, expert_bytes=EXPERT_30B, dense=0, budget=8 * GiB, chunk_tokens=512,
                    kv_tokens=512, resident_per_layer=128)


def test_forced_and_uncapped():
    forced = plan_memory(SPEC_30B, n_layers=48, expert_bytes=EXPERT_30B, dense=0, budget=16 * GiB, chunk_tokens=512,
                         kv_tokens=512, resident_per_layer=0)
    assert forced.resident == 0 and forced.ring == 2 * 128 * EXPERT_30B
    cpu = plan_memory(SPEC_30B, n_layers=4, expert_bytes=100, dense=0, budget=None, chunk_tokens=64, kv_tokens=64)
    assert cpu.resident_per_layer == 32 and "budget" not in dict(cpu.lines())


def test_longer_context_than_vram_kv_adds_a_staging_line():
    plan = plan_memory(SPEC_30B, n_layers=48, expert_bytes=EXPERT_30B, dense=int(3.3e9), budget=16 * GiB,
                       chunk_tokens=8192, kv_tokens=8192, context=40960, staging_buffers=2)
    assert plan.kv_staging == 2 * 2 * 40960 * 512 * 2  # two buffers of one layer's keys and values
    assert plan.kv == kv_bytes(SPEC_30B, 48, 8192) and plan.total <= 16 * GiB
    assert plan_memory(SPEC_30B, n_layers=48, expert_bytes=EXPERT_30B, dense=0, budget=16 * GiB, chunk_tokens=512,
                       kv_tokens=4096, context=4096).kv_staging == 0


def test_line_formulas_scale_as_stated():
    s = SPEC_30B
    assert workspace_bytes(s, 4) == 2 * workspace_bytes(s, 2)
    assert kv_bytes(s, 48, 32768) == 32768 * 96 * 1024  # 96 KB a token for this model
    assert activation_bytes(s, 8192, 8192) > activation_bytes(s, 1024, 1024)
    assert activation_bytes(s, 1024, 40960) > activation_bytes(s, 1024, 1024)  # long contexts: attention rules


shapes = st.builds(
    lambda base, layers, experts, used, hidden, ffn, heads, kv_heads: dataclasses.replace(
        base, n_layers=layers, n_experts=experts, n_experts_used=min(used, experts), hidden=hidden,
        expert_ffn=ffn, n_heads=heads, n_kv_heads=kv_heads, head_dim=hidden // heads),
    st.just(SPEC_30B), st.integers(1, 96), st.integers(1, 256), st.integers(1, 8),
    st.sampled_from([256, 1024, 2048, 4096, 7168]), st.sampled_from([64, 768, 1536, 2560]),
    st.sampled_from([8, 16, 32, 64]), st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=300, deadline=None)
@given(spec=shapes, budget_gib=st.floats(0.5, 200), expert_kb=st.integers(1, 20_000), dense_gb=st.floats(0, 20),
       chunk=st.integers(1, 16384), kv_tokens=st.integers(1, 262144), slots=st.integers(1, 4),
       layers=st.integers(1, 96), context=st.one_of(st.none(), st.integers(1, 262144)))
def test_plan_never_exceeds_the_budget(spec, budget_gib, expert_kb, dense_gb, chunk, kv_tokens, slots, layers,
                                       context):
    budget = int(budget_gib * GiB)
    args = dict(n_layers=layers, expert_bytes=expert_kb * 1000, dense=int(dense_gb * 1e9), chunk_tokens=chunk,
                kv_tokens=kv_tokens, ring_slots=slots, context=context)
    try:
        plan = plan_memory(spec, budget=budget, **args)
    except PlanError:
        zero = plan_memory(spec, budget=None, resident_per_layer=0, **args)
        # refused only when nothing would fit (the uncapped plan has no slack and no decode line)
        assert zero.total + int(0.03 * budget) + decode_bytes(spec, 8, head=True) > budget
        return
    assert plan.total <= budget
    placed = [n for what, n in plan.lines()]
    assert sum(placed[:placed.index(plan.total)]) == plan.total  # the lines before "total" add up to it
    assert 0 <= plan.resident_per_layer <= spec.n_experts
    if plan.resident_per_layer < spec.n_experts:  # one more resident expert a layer would not fit
        more = dataclasses.replace(plan, resident_per_layer=plan.resident_per_layer + 1)
        assert more.total > budget or plan.resident_per_layer + 1 == spec.n_experts


def test_a_stage_halves_its_vram_kv_where_the_context_does_not_fit():
    halvings = []
    plan = plan_stage_memory(SPEC_30B, kv_tokens=32768, context=32768, chunk_tokens=8192,
                             on_halved=lambda had, now: halvings.append((had, now)), n_layers=48,
                             expert_bytes=EXPERT_30B, dense=int(3.11e9), budget=8 * GiB, staging_buffers=2)
    assert halvings == [(32768, 16384), (16384, 8192)] and plan.kv_tokens == 8192  # as the H200 run logged
    assert plan.kv_staging == 2 * 2 * 32768 * 512 * 2 and plan.total <= 8 * GiB  # the rest spills to host RAM
    with pytest.raises(PlanError):  # down to one chunk, not below
        plan_stage_memory(SPEC_30B, kv_tokens=32768, context=32768, chunk_tokens=8192, n_layers=48,
                          expert_bytes=EXPERT_30B, dense=int(3.11e9), budget=int(6.5 * GiB))
