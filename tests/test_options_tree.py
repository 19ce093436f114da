"""The options as one frozen chain: `StageSwitches` declares what every stage runs by, a `Placement`
is one, and each stage's `StageOptions` holds it whole beside what was resolved for that stage."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu import env
from strata_mgpu.config import HostShare, Placement, StageSwitches
from strata_mgpu.engine.build import stage_options
from strata_mgpu.stage.stage import StageOptions

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_every_stage_holds_the_placement_whole():
    placement = Placement(devices=("cpu", "cpu"), max_vram_gib=(2.0, 3.5), dense_blocks=False,
                          cpu_experts=HostShare("fixed", 0.5), decode_graph_batch=4, threads=3)
    options = stage_options(placement, 256, 1024, devices=[CPU, CPU])
    assert all(o.switches is placement for o in options)
    assert [o.max_vram_gib for o in options] == [2.0, 3.5]
    assert [o.max_vram_bytes for o in options] == [2 * 2**30, int(3.5 * 2**30)]
    assert [(o.chunk_size, o.kv_tokens, o.context, o.threads) for o in options] == [(256, 1024, 1024, 3)] * 2
    assert not any(o.host_core_experts for o in options)  # a split's CPU stages keep the device path's twins


def test_the_compute_dtype_is_derived_once():
    assert StageOptions(device=CPU).compute_dtype == torch.float32  # bf16 is the GPU's
    assert StageOptions(device=CUDA).compute_dtype == torch.bfloat16
    assert StageOptions(device=CUDA, switches=StageSwitches(dtype="fp32")).compute_dtype == torch.float32
    assert StageOptions(device=CPU, dtype=torch.bfloat16).compute_dtype == torch.bfloat16  # a tool's own
    assert StageOptions(device=CUDA).max_vram_bytes is None


def test_the_environment_sets_switches_and_the_flags_win():
    environment = env.read({"STRATA_DENSE_BLOCKS": "0", "STRATA_DECODE_GRAPH_BATCH": "2"})
    switches = StageSwitches.from_env(environment, decode_graph_batch=16)
    assert (switches.dense_blocks, switches.decode_graph_batch) == (False, 16)
    placement = Placement.from_env(environment, devices=("cpu",))
    assert (placement.dense_blocks, placement.decode_graph_batch) == (False, 2)


@pytest.mark.parametrize("cls", [StageSwitches, Placement])
@pytest.mark.parametrize(("field", "value", "message"), [
    ("dtype", "fp16", "bf16 or fp32"), ("decode_graph_batch", 0, "1 to 64"),
    ("resident_experts", -1, "0 or more")])
def test_a_bad_switch_is_refused_wherever_it_is_given(cls, field, value, message):
    with pytest.raises(ValueError, match=message):
        cls(**{field: value})
