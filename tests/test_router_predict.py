"""tools/router_predict: layer i+1's picks predicted from layer i's hidden state, and an LFU's hits."""

from __future__ import annotations

import torch

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from strata_mgpu.tools.router_predict import RouterRecord, corpus_prompts, hit_rates, lfu_hit_rate, record_routing


def test_hit_rates_count_the_true_picks_predicted():
    picks = [[torch.tensor([[0, 1]])], [torch.tensor([[2, 3]]), torch.tensor([[4, 5]])]]
    predicted = [[], [torch.tensor([[3, 7, 2, 6]]), torch.tensor([[9, 8, 4, 1]])]]
    # row 1: 3 in the top 2, 2 in the top 4; row 2: none in the top 2, 4 in the top 4
    assert hit_rates(RouterRecord(picks, predicted), n_used=2) == [(0.25, 0.75)]


def test_an_lfu_holds_a_steady_favourite_and_decays_an_old_one():
    rows = [torch.tensor([[3, e % 8]]) for e in range(200)]
    assert lfu_hit_rate(rows, 8, 1, half_life=0) >= 0.49  # expert 3, every row's first pick
    switch = [torch.tensor([[1]])] * 100 + [torch.tensor([[2]])] * 100
    assert lfu_hit_rate(switch, 4, 1, half_life=4) > lfu_hit_rate(switch, 4, 1, half_life=0) + 0.3


def test_the_stage_is_recorded_row_by_row(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=torch.device("cpu")))
    prompts = corpus_prompts(f, spec, 2, 12, seed=0)
    record = record_routing(stage, prompts)
    assert stage.model.routing is None
    assert all(sum(p.shape[0] for p in layer) == 24 for layer in record.picks)
    assert record.predicted[0] == [] and all(sum(p.shape[0] for p in record.predicted[i]) == 24
                                             for i in range(1, spec.n_layers))
    for top_a, top_2a in hit_rates(record, spec.n_experts_used):
        assert 0.0 <= top_a <= top_2a <= 1.0
