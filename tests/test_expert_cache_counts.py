"""The expert cache's pick counts (stage.experts.cache.ExpertCache.observe): exact, and kept by one
tensor that never changes address, since a captured decode graph reads its operands at the
addresses they had at capture (a replaced buffer would be freed under the graph)."""

from __future__ import annotations

import torch

from strata_mgpu.config import StageSwitches
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions


def test_counts_are_exact_and_their_operand_never_moves(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    cache = build_stage(f, spec, StageOptions(device=torch.device("cpu"))).experts.cache
    one = cache._one.data_ptr()
    g = torch.Generator().manual_seed(0)
    before = cache.picks.clone()
    for rows in (1, 300, 2):  # a decode row, a prompt, a batch
        experts = torch.randint(0, spec.n_experts, (rows, spec.n_experts_used), generator=g)
        cache.observe(1, experts)
        before[1] += torch.bincount(experts.reshape(-1), minlength=spec.n_experts).float()
        assert torch.equal(cache.picks, before) and cache._one.data_ptr() == one


def test_tally_counts_each_pick_where_it_was_read_across_swaps(tiny_gguf):
    """`tally`: picks read from VRAM and all picks since the cache was made, each counted under
    the residency of its time, though the residency moves experts and decays the scores between."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=torch.device("cpu")))
    cache = stage.experts.cache
    assert 0 < cache.per_layer < spec.n_experts
    g = torch.Generator().manual_seed(1)
    vram = total = 0.0
    for _ in range(4):
        for layer in range(spec.n_layers):
            hot = spec.n_experts - 1 - layer % 2  # not resident at first: refills bring it in
            experts = torch.randint(0, spec.n_experts, (20, spec.n_experts_used), generator=g)
            experts[:, 0] = hot
            resident = cache.slot_of_host[layer] >= 0
            vram += float(resident[experts].sum())
            total += experts.numel()
            cache.observe(layer, experts)
        assert cache.tally() == (vram, total)
        assert not cache.picks.any()  # flushed: the device counts start again from zero
        stage.refill.settle()
    assert cache.swapped > 0  # residency did change between tallies


def test_a_cache_of_every_expert_counts_nothing_and_reads_all_from_vram(tiny_gguf):
    """Where every expert is resident there is nothing to learn: no count (a launch a layer saved
    in every decode step), and the share read from VRAM is 1 without one."""
    from strata_mgpu.stage.experts.cache import vram_share

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    full = build_stage(f, spec, StageOptions(device=torch.device("cpu"),
                                             switches=StageSwitches(resident_experts=spec.n_experts)))
    part = build_stage(f, spec, StageOptions(device=torch.device("cpu"), switches=StageSwitches(resident_experts=2)))
    assert full.experts.cache.holds_every_expert and not part.experts.cache.holds_every_expert
    prompt = torch.randint(0, spec.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    for stage in (full, part):
        stage.prefill(stage.new_sequence(32), prompt)
    assert not full.experts.cache.picks.any()
    assert float(part.experts.cache.picks.sum()) == 12 * spec.n_experts_used * spec.n_layers
    caches = [full.experts.cache]
    assert vram_share(caches, *full.experts.cache.tally()) == 1.0
    assert vram_share([part.experts.cache], 30.0, 40.0) == 0.75
    assert vram_share([], 0.0, 0.0) is None and vram_share([part.experts.cache], 0.0, 0.0) is None
