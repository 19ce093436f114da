"""Which way a pass takes through a stage's experts (stage.experts.streamed.gather_pick_limit):
whole layers from E picks where experts stream; gathered further where all are resident and the
fused kernels need no workspace."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.streamed import GATHER_PICKS_BY_PICK, GATHER_PICKS_RESIDENT, gather_pick_limit
from strata_mgpu.stage.stage import StageOptions


@pytest.mark.parametrize("all_resident,fused,grouped,want", [
    (False, False, False, 128), (False, True, True, 128), (True, False, False, 128),
    (True, True, False, GATHER_PICKS_BY_PICK), (True, True, True, GATHER_PICKS_RESIDENT)])
def test_limit(all_resident, fused, grouped, want):
    assert gather_pick_limit(128, all_resident, fused, grouped) == want


def test_more_experts_than_the_resident_limit_keep_their_count():
    assert gather_pick_limit(4 * GATHER_PICKS_RESIDENT, True, True) == 4 * GATHER_PICKS_RESIDENT


def test_a_cpu_stage_streams_from_e_picks(tiny_gguf):
    """The twin's gather dequantizes into a workspace of E experts: no more picks than that."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    experts = build_stage(f, spec, StageOptions(device=torch.device("cpu"))).experts
    assert experts.gather_picks == spec.n_experts
    rows = spec.n_experts // spec.n_experts_used
    assert not experts.should_stream(rows - 1) and experts.should_stream(rows)
