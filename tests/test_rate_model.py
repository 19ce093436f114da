"""The rate model against the two-H200 sweep of issue #13, its pick, bounds and estimate updates."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from strata_mgpu.split.help_rule import default_share
from strata_mgpu.split.rate_model import (
    MAX_STEP,
    ComputeRates,
    RateEstimate,
    StageLoad,
    best_share,
    binding_term,
    link_bounds,
    one_chunk_link_bound,
    stage_seconds,
)
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.host.link import link_rate, measure_link_rate

# Issue #13: two H200s (55.4 / 55.3 GB/s pinned H2D), 30b-a3b (48 layers split 24 + 24, 391.6 MB
# of experts a layer), `strata sweep --devices 0,1 --layer-split auto --max-vram 16,16 --runs 3`:
# seconds per one-chunk prompt, median of 3.
SHARES = [0, 0.2, 0.3, 0.35, 0.4, 0.45, 0.5]
H200_SECONDS = {
    1024: [0.333, 0.274, 0.244, 0.226, 0.211, 0.193, 0.212],
    2048: [0.334, 0.283, 0.253, 0.236, 0.219, 0.201, 0.191],
    3072: [0.334, 0.292, 0.262, 0.243, 0.228, 0.209, 0.199],
    4096: [0.336, 0.303, 0.271, 0.254, 0.238, 0.236, 0.239],
    6144: [0.338, 0.331, 0.338, 0.342, 0.340, 0.342, 0.343],
    8192: [0.342, 0.435, 0.443, 0.450, 0.453, 0.458, 0.451],
}
OUTLIER = (1024, 0.5)  # slower than 2K at the same share: no cost that grows with T explains it
H200_LOADS = [StageLoad(first_layer=0, layers=24, streamed_bytes=391.6e6, n_experts=128, link_busy=55.4e9,
                        link_helper=55.3e9, to_helper_bytes=2048 * 2 + 8 * 12, back_bytes=2048 * 2),
              StageLoad(first_layer=24, layers=24, streamed_bytes=391.6e6, n_experts=128, link_busy=55.3e9,
                        link_helper=55.4e9, to_helper_bytes=2048 * 2 + 8 * 12, back_bytes=2048 * 2)]


def predicted(tokens: int, share: float, rates: ComputeRates | None = None) -> float:
    return sum(stage_seconds(x, rates or ComputeRates(), share, tokens) for x in H200_LOADS)


def measured(tokens: int, share: float) -> float:
    """The table, linearly between its measured shares."""
    return float(np.interp(share, SHARES, H200_SECONDS[tokens]))


def test_model_reproduces_the_h200_table():
    errors = {(t, s): predicted(t, s) / m - 1 for t, row in H200_SECONDS.items() for s, m in zip(SHARES, row,
                                                                                                 strict=True)}
    worst = max((k for k in errors if k != OUTLIER), key=lambda k: abs(errors[k]))
    assert abs(errors[worst]) < 0.02, f"{worst}: {100 * errors[worst]:+.1f}%"
    # the one cell the model misses, named: it predicts that cell faster than measured, by less than a fifth
    assert -0.2 < errors[OUTLIER] < -0.02


def test_auto_pick_against_the_measured_best():
    """Measured time at auto's pick within 3% of the best measured share at every length but 1K,
    where the outlier cell makes that impossible for any pick that does not rise from 1K to 2K
    (1K needs <= 0.465, 2K >= 0.471): there auto loses 8.3%. The rule loses up to 42%."""
    for tokens, row in H200_SECONDS.items():
        picks = {best_share(x, ComputeRates(), tokens) for x in H200_LOADS}
        assert len(picks) == 1  # the two stages alike
        pick = picks.pop()
        assert pick * 128 == round(pick * 128)  # a split the runner can make
        gap = measured(tokens, pick) / min(row) - 1
        assert gap < (0.09 if tokens == 1024 else 0.03), f"{tokens}: share {pick:.3f} is {100 * gap:.1f}% off"
    rule_gaps = [measured(t, default_share(t)) / min(row) - 1 for t, row in H200_SECONDS.items()]
    assert max(rule_gaps) > 0.4


def test_picks_follow_the_bounds():
    """Short prompts: near the balance of the two links; long ones (compute and hand-over bound):
    no help at all; one link or an unmeasured one: no help."""
    load = H200_LOADS[0]
    assert 0.45 < best_share(load, ComputeRates(), 2048) <= 0.5
    assert best_share(load, ComputeRates(), 8192) == 0.0
    assert binding_term(load, ComputeRates(), 0.3, 8192) == "chain"
    assert binding_term(load, ComputeRates(), 0.3, 1024) == "link"
    assert best_share(replace(load, link_helper=None), ComputeRates(), 2048) == 0.0
    slow_helper = replace(load, link_helper=load.link_busy / 4)  # a x4 card: it can take less
    assert 0 < best_share(slow_helper, ComputeRates(), 1024) < best_share(load, ComputeRates(), 1024)


def test_overlapped_handover_is_never_slower_and_helps_longer_prompts():
    over = ComputeRates(overlapped=True)
    for tokens in H200_SECONDS:
        for share in SHARES:
            assert predicted(tokens, share, over) <= predicted(tokens, share) + 1e-12
    assert predicted(4096, 0.45, over) < 0.97 * predicted(4096, 0.45)  # chain-bound there today
    assert predicted(1024, 0.2, over) == pytest.approx(predicted(1024, 0.2))  # link-bound: no change


def test_link_bounds():
    load = H200_LOADS[0]
    off, helped = link_bounds(load, 0)
    assert off == pytest.approx(24 * 391.6e6 / 55.4e9)
    assert helped == pytest.approx(24 * 391.6e6 / (55.4e9 + 55.3e9))  # both links, balanced
    off8, helped8 = link_bounds(load, 8192)
    assert off8 == off and helped < helped8 < off  # the hand-over's bytes load both links
    for tokens, row in H200_SECONDS.items():  # bounds are bounds
        assert sum(link_bounds(x, tokens)[1] for x in H200_LOADS) < min(row)


def test_one_chunk_link_bound():
    """The stages one after the other: their bytes over their links less what a later stage's
    rings took in early; helped across cards, each stage's larger link load; on one card both
    loads over the one link."""
    a, b = H200_LOADS
    each = [24 * 391.6e6 / 55.4e9, 24 * 391.6e6 / 55.3e9]
    assert one_chunk_link_bound([(a, 0.0, True, 0, 0), (b, 0.0, True, 0, 0)], 8192) == pytest.approx(sum(each))
    ring = 2 * 391.6e6  # two layers' slots
    early = one_chunk_link_bound([(a, 0.0, True, 0, 0), (b, 0.0, True, ring, 0)], 8192)
    assert early == pytest.approx(sum(each) - ring / 55.3e9)
    half = one_chunk_link_bound([(a, 0.5, True, 0, 0), (b, 0.5, True, 0, 0)], 0)
    assert half == pytest.approx(sum(each) / 2, rel=1e-3)
    # each side less its own ring's early bytes: the later stage's helper side binds here
    side = 0.5 * 24 * 391.6e6
    assert one_chunk_link_bound([(a, 0.5, True, 0, 0), (b, 0.5, True, ring, ring / 2)], 0) == pytest.approx(
        side / 55.3e9 + max((side - ring) / 55.3e9, (side - ring / 2) / 55.4e9))
    at_8k = one_chunk_link_bound([(a, 0.5, True, 0, 0), (b, 0.5, True, 0, 0)], 8192)
    assert half < at_8k < sum(each)  # the hand-over's bytes, read in and back, cost link time
    busy_side = 24 * (0.5 * 391.6e6 + 8192 * a.back_bytes) / a.link_busy
    helper_side = 24 * (0.5 * 391.6e6 + 8192 * a.to_helper_bytes) / a.link_helper
    assert one_chunk_link_bound([(a, 0.5, True, 0, 0)], 8192) == pytest.approx(max(busy_side, helper_side))
    one_card = one_chunk_link_bound([(a, 0.5, False, 0, 0)], 8192)  # the helper's bytes take the same link
    assert one_card == pytest.approx(24 * (391.6e6 + 8192 * (a.back_bytes + a.to_helper_bytes)) / a.link_busy)
    assert one_chunk_link_bound([(a, 0.0, True, 1e12, 0)], 8192) == 0  # a ring larger than the stage's bytes
    for tokens, row in H200_SECONDS.items():  # bounds are bounds, at every measured share
        for share, seconds in zip(SHARES, row, strict=True):
            assert one_chunk_link_bound([(a, share, True, 0, 0), (b, share, True, ring, 0)], tokens) < seconds


def test_observe_converges_on_each_term():
    """A card whose rates differ from the defaults: timed prompts bring the prediction there."""
    fast_link = replace(H200_LOADS[0], streamed_bytes=40e6)  # compute-bound unhelped at 8K
    cases = [(fast_link, ComputeRates(other_s_per_token=0.6e-6, expert_s_per_token=0.3e-6), 8192, 0.0),
             (H200_LOADS[0], ComputeRates(mapped_bytes_per_s=12e9), 8192, 0.3),
             (H200_LOADS[0], ComputeRates(helper_latency_s=0.6e-3), 1024, 0.5),
             (H200_LOADS[0], ComputeRates(fixed_s=5e-3), 1024, 0.0)]
    for load, truth, tokens, share in cases:
        est = RateEstimate()
        est.share(load, tokens)
        before = abs(est.predict(tokens, share) / stage_seconds(load, truth, share, tokens) - 1)
        for _ in range(12):
            est.observe(tokens, share, stage_seconds(load, truth, share, tokens))
        after = abs(est.predict(tokens, share) / stage_seconds(load, truth, share, tokens) - 1)
        assert before > 0.04 and after < 0.01, (truth, before, after)
        assert est.observed == 12
    est = RateEstimate()
    est.share(H200_LOADS[0], 1024)
    est.observe(1024, 0.45, 1.0e3)  # a hiccup moves the helper's latency by one bounded step at most
    assert est.rates.helper_latency_s <= H200_LOADS[0].streamed_bytes / H200_LOADS[0].link_helper
    est.observe(1024, 0.45, float("nan"))
    assert est.observed == 1


def test_observe_moves_the_pick_toward_a_slower_helper():
    est = RateEstimate()
    first = est.share(H200_LOADS[0], 1024)
    truth = ComputeRates(helper_latency_s=0.6e-3)
    for _ in range(12):
        est.observe(1024, None, stage_seconds(H200_LOADS[0], truth, est.share(H200_LOADS[0], 1024), 1024))
    assert est.share(H200_LOADS[0], 1024) < first
    assert est.share(H200_LOADS[0], 1024) == pytest.approx(best_share(H200_LOADS[0], truth, 1024), abs=2 / 128)


def test_estimate_without_loads_observes_nothing():
    est = RateEstimate()
    est.observe(1024, 0.3, 0.2)
    assert est.observed == 0 and est.predict(1024) is None
    assert MAX_STEP > 1


def test_link_probe_on_cpu_is_none():
    ctx = DeviceContext(torch.device("cpu"))
    assert measure_link_rate(ctx) is None and link_rate(ctx) is None


@pytest.mark.gpu
def test_link_probe_on_gpu():
    ctx = DeviceContext(torch.device("cuda", 0))
    rate = measure_link_rate(ctx, nbytes=64 * 2**20)
    assert rate is not None and 1e9 < rate < 1e12  # PCIe 3 x4 .. beyond any link today
    assert link_rate(ctx) == rate
