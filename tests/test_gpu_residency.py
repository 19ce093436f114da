"""GPU checks (marker `gpu`) of the few-row break-even and the residency where CUDA differs from the
twins: measured rates, the fused gathered kernels past E picks, swaps on the upload stream under
graph replays."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.config import StageSwitches
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.break_even import EXPERT_DEQUANT_S, PICK_S
from strata_mgpu.stage.experts.residency import PERIOD
from strata_mgpu.stage.stage import StageOptions
from tests.test_gpu import BF16_Q8_TOL, rel_err

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_residency") / "small.gguf"
    write_model(path, "small", seed=3)
    f = GGUFFile(path)
    return f, spec_from_gguf(f)


def test_a_few_row_prompt_gathers_below_the_measured_break_even_and_answers_as_streaming(small):
    f, spec = small
    stage = build_stage(f, spec, StageOptions(device=CUDA, switches=StageSwitches(
        resident_experts=spec.n_experts // 2, cuda_graphs=False)))
    experts = stage.experts
    rates = experts.rates
    assert rates is not None and rates.mapped_bytes_per_s > 1e9  # both probes ran, and the compute's
    assert rates.pick_s != PICK_S and rates.expert_s != EXPERT_DEQUANT_S and rates.pick_s > 0 < rates.expert_s
    rows = experts.stream_rows()
    assert stage.options.switches.decode_graph_batch <= rows <= 512 // spec.n_experts_used
    n = rows - 1
    prompt = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    picked: dict[int, torch.Tensor] = {}
    route = stage.model.route

    def recording(i, h, router):
        weights, chosen = route(i, h, router)
        picked[i] = chosen
        return weights, chosen

    def forced(i, h, router):  # the gathered pass's picks: only the two paths' arithmetic differs
        probs = torch.softmax(h.float() @ router.float().T, dim=-1).gather(1, picked[i])
        return probs / probs.sum(-1, keepdim=True), picked[i]

    before = stage.kernels.paths.get("moe_gathered:fused", 0)
    stage.model.routing = recording
    gathered = stage.prefill(stage.new_sequence(n + 1), prompt)
    assert stage.kernels.paths["moe_gathered:fused"] - before == spec.n_layers
    experts.set_gather_rule(None, floor_rows=1, fixed_rows=1)
    stage.model.routing = forced
    streamed = stage.prefill(stage.new_sequence(n + 1), prompt)
    assert experts.ring is not None and experts.ring.uploaded_bytes >= experts.pass_bytes()
    assert rel_err(gathered, streamed) <= BF16_Q8_TOL  # the gathered side runs 8-bit activations


def test_swaps_on_the_upload_stream_under_graph_replays_read_the_same_bytes(small):
    """A stage moving a hot expert into every layer, its decode steps replayed as graphs, against one
    held still: the same logits bit for bit at every step (the fused kernels read an expert's bytes
    from a slot or from the mapped arena alike), the tables on the device equal to the host's."""
    f, spec = small
    k = spec.n_experts // 2
    moving = build_stage(f, spec, StageOptions(device=CUDA, switches=StageSwitches(resident_experts=k,
                                                                                   residency_swaps=2)))
    still = build_stage(f, spec, StageOptions(device=CUDA, switches=StageSwitches(resident_experts=k,
                                                                                  residency_swaps=0)))
    prompt = torch.randint(0, spec.vocab_size, (4,), generator=torch.Generator().manual_seed(2))
    kvs = [s.new_sequence(128) for s in (moving, still)]
    for s, kv in zip((moving, still), kvs, strict=True):
        s.prefill(kv, prompt)
    cache = moving.experts.cache
    cache.picks[:, spec.n_experts - 1] = 1e4  # not resident at load
    g = torch.Generator().manual_seed(3)
    for _ in range(3 * PERIOD):
        token = torch.randint(0, spec.vocab_size, (1,), generator=g)
        a, b = (s.decode([kv], token) for s, kv in zip((moving, still), kvs, strict=True))
        assert torch.equal(a, b)
    assert moving.graphs.captured  # the steps replayed graphs
    assert cache.swapped >= spec.n_layers
    assert all(int(cache.slot_of_host[i, spec.n_experts - 1]) >= 0 for i in range(spec.n_layers))
    torch.cuda.synchronize(CUDA)
    assert torch.equal(cache.slot_of.cpu(), cache.slot_of_host)


def test_the_start_warms_both_prompt_paths_and_keeps_the_counts(small):
    f, spec = small
    stage = build_stage(f, spec, StageOptions(device=CUDA,
                                              switches=StageSwitches(resident_experts=spec.n_experts // 2)))
    cache = stage.experts.cache
    counts = cache.picks.clone()
    before = dict(stage.kernels.paths)
    stage.warm_decode_graphs(256)
    assert torch.equal(cache.picks, counts)
    assert stage.kernels.paths["moe_gathered:fused"] > before.get("moe_gathered:fused", 0)
    assert stage.experts.ring is not None and stage.experts.ring.uploaded_bytes >= stage.experts.pass_bytes()
