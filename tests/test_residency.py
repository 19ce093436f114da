"""Which experts stay resident (stage.experts.residency): the LFU's invariants, and a CPU stage whose
traffic concentrates on a few experts holding them, its answers the oracle's through every swap."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_mgpu.config import StageSwitches
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.residency import PERIOD, LfuPolicy, hit_share
from strata_mgpu.stage.stage import StageOptions

CPU = torch.device("cpu")


@st.composite
def residencies(draw):
    layers, experts = draw(st.integers(1, 4)), draw(st.integers(2, 12))
    slots = draw(st.integers(0, experts))
    counts = np.array(draw(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=layers * experts,
                                    max_size=layers * experts))).reshape(layers, experts)
    resident = np.zeros((layers, experts), dtype=bool)
    for i in range(layers):
        resident[i, draw(st.permutations(range(experts)))[:slots]] = True
    return counts, resident, slots


@settings(max_examples=200, deadline=None)
@given(residencies(), st.integers(0, 20), st.floats(1.0, 3.0), st.floats(0.0, 5.0))
def test_swaps_keep_the_slots_respect_the_budget_and_only_gain(case, budget, margin, min_count):
    counts, resident, slots = case
    policy = LfuPolicy(half_life=64, margin=margin, min_count=min_count)
    swaps = policy.swaps(counts, resident, budget)
    assert len(swaps) <= budget
    after = resident.copy()
    for s in swaps:
        assert after[s.layer, s.out] and not after[s.layer, s.into]  # applied in order, each is valid
        assert counts[s.layer, s.into] > margin * counts[s.layer, s.out] + min_count
        after[s.layer, s.out], after[s.layer, s.into] = False, True
    assert (after.sum(1) == slots).all()  # never more resident than slots, none left empty
    assert (counts * after).sum() >= (counts * resident).sum()
    before_hit, after_hit = hit_share(counts, resident), hit_share(counts, after)
    assert (before_hit is None) == (after_hit is None) == (counts.sum() == 0)
    if after_hit is not None:
        assert 0.0 <= after_hit <= 1.0 and after_hit >= before_hit - 1e-12
    # a larger budget takes these swaps first: the best gains, in order
    assert policy.swaps(counts, resident, budget + 3)[:len(swaps)] == swaps


@settings(max_examples=100, deadline=None)
@given(st.floats(1.0, 1e5), st.integers(0, 10_000), st.integers(0, 10_000))
def test_decay_is_monotone_and_halves_at_the_half_life(half_life, a, b):
    policy = LfuPolicy(half_life)
    assert 0.0 <= policy.decay(max(a, b)) <= policy.decay(min(a, b)) <= 1.0  # (far past: underflows to 0)
    assert policy.decay(0) == 1.0
    assert abs(policy.decay(half_life) - 0.5) < 1e-12
    assert abs(policy.decay(a) * policy.decay(b) - policy.decay(a + b)) <= 1e-9


def test_near_ties_do_not_churn():
    counts = np.array([[10.0, 14.0, 30.0, 0.0]])
    resident = np.array([[True, False, False, True]])
    swaps = LfuPolicy(64, margin=1.5, min_count=1.0).swaps(counts, resident, 8)
    # 30 takes the slot of 0 (the coldest); 14 is within 1.5 x 10 + 1 of 10: it stays out
    assert [(s.out, s.into) for s in swaps] == [(3, 2)]


def concentrate(hot: list[int], spec):
    """Routing that picks only among `hot` experts (their router logits, the others masked)."""
    mask = torch.full((spec.n_experts,), float("-inf"))
    mask[hot] = 0.0

    def routing(i, h, router):
        logits = h.float() @ router.float().T + mask  # [T, E]
        probs = torch.softmax(logits, dim=-1)
        weights, experts = probs.topk(spec.n_experts_used, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.float(), experts
    return routing


def test_concentrated_traffic_becomes_resident_and_answers_stay_the_oracles(tiny_gguf):
    """Decode whose picks all fall on 3 of 8 experts (2 resident slots a layer, experts 0 and 1 at
    load): within a few flushes each layer holds 2 of the 3, at most `swaps_per_step` experts moved a
    step, and every step's logits equal the oracle's (fp32, 1e-5 of their scale) and those of a stage
    whose residency is held still, bit for bit."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    hot = [4, 6, 7]
    ref = load_reference_runner(f, spec)
    moving = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2,
                                                                                  residency_swaps=1)))
    still = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2,
                                                                                 residency_swaps=0)))
    for runner in (ref, moving, still):
        runner.model.routing = concentrate(hot, spec)
    cache = moving.experts.cache
    assert all(set(np.flatnonzero(cache.slot_of_host[i].numpy() >= 0)) == {0, 1} for i in range(spec.n_layers))
    prompt = torch.randint(0, spec.vocab_size, (6,), generator=torch.Generator().manual_seed(4))
    kvs = [r.new_sequence(64) for r in (ref, moving, still)]
    outs = [r.prefill(kv, prompt) for r, kv in zip((ref, moving, still), kvs, strict=True)]
    swapped = []
    for _ in range(5 * PERIOD):
        token = torch.tensor([int(outs[0].argmax())])
        outs = [r.decode([kv], token)[0] for r, kv in zip((ref, moving, still), kvs, strict=True)]
        assert (outs[1] - outs[0]).abs().max() <= 1e-5 * outs[0].abs().max()
        assert torch.equal(outs[1], outs[2])  # the same bytes read, from a slot or from the arena
        swapped.append(cache.swapped)
    assert all(b - a <= 1 for a, b in zip([0, *swapped], swapped, strict=False))  # the budget a step
    for i in range(spec.n_layers):
        held = set(np.flatnonzero(cache.slot_of_host[i].numpy() >= 0).tolist())
        assert len(held) == 2 and held <= set(hot), (i, held)
    assert torch.equal(cache.slot_of, cache.slot_of_host)
    assert cache.expected_hit > 0.5  # what the break-even now reckons with (2 of the 3 picked experts)
    assert still.experts.cache.swapped == 0


def test_a_streamed_prompt_between_a_swaps_two_steps_lands_it_first(tiny_gguf):
    """A prompt that streams whole layers, begun while an expert is out of the table and its successor's
    upload not yet in (a swap's two steps): the ring holds E - K experts a layer, so the pass lands
    the swap first, and answers as a stage whose residency is held still."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    moving = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2)))
    still = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2,
                                                                                 residency_swaps=0)))
    cache = moving.experts.cache
    cache.picks[:, spec.n_experts - 1] = 100.0
    for _ in range(PERIOD):
        moving.refill_cache([])
    assert cache._moving and cache.swapped == 0  # evicted, uploaded, not yet in the table
    prompt = torch.randint(0, spec.vocab_size, (3 * spec.n_experts,), generator=torch.Generator().manual_seed(5))
    assert moving.experts.should_stream(prompt.numel())
    a = moving.prefill(moving.new_sequence(64), prompt)
    assert not cache._moving and cache.swapped > 0
    assert torch.equal(a, still.prefill(still.new_sequence(64), prompt))
