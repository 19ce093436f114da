"""GPU checks of the decode hand-over of missing experts to the host's cores (marker `gpu`):
cpu_handover.cu's choices against `assign_host`, a layer's sums with the hand-over against the
fused kernels alone, and decode steps (eager and replayed as graphs) against the reference."""

from __future__ import annotations

import gc

import pytest
import torch

from strata_mgpu.config import HostShare, StageSwitches
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.cpu_handover import CpuHandover
from strata_mgpu.stage.experts.share_policy import assign_host
from strata_mgpu.stage.stage import StageOptions

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
# the GPU's picks through the integer kernels (8-bit activations), the host's through ggml (Q8_K):
# each rounds its own way, against the fused kernels alone
LAYER_TOL = 3e-2
STEP_TOL = 5e-2  # decode logits against the fp32 reference (tests/test_gpu.py's BF16_Q8_TOL is 3e-2)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


def stage_with(tiny_gguf, share: str, **switches):
    """Decode's hand-over: prompts of 2 rows or more stream whole layers (`gather_rows` fixed), so a
    prompt's rows are not handed to the host too (the measured break-even of these tiny experts would
    gather them)."""
    gc.collect()
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    switches = {"gather_rows": 2, **switches}
    return f, spec, build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=4, threads=2, switches=StageSwitches(
        resident_experts=2, cpu_experts=HostShare.parse(share), **switches)))


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("share", ["0.5", "1"])
def test_a_layer_with_the_hand_over_equals_the_fused_kernels_alone(tiny_gguf, rows, share):
    f, spec, stage = stage_with(tiny_gguf, share)
    experts = stage.experts
    handover = experts.handover
    assert isinstance(handover, CpuHandover), "the stage built no hand-over"
    cache, ws, kernels = experts.cache, experts.workspace, experts.kernels
    torch.manual_seed(rows)
    a, i = spec.n_experts_used, 1
    lay = stage.arena.layouts[stage.layers[i]]
    resident = (cache.slot_of_host[i] >= 0).numpy()
    for rep in range(3):
        h = (torch.randn(rows, spec.hidden, device=CUDA) * 0.5).bfloat16()
        picks = torch.stack([torch.randperm(spec.n_experts)[:a] for _ in range(rows)]).to(CUDA)
        weights = torch.softmax(torch.randn(rows, a, device=CUDA), dim=1)
        carry = float(handover.carry)
        want_host, want_carry = assign_host(picks.reshape(-1).tolist(), resident, float(share), carry)
        handover.arm()
        own = handover.send(i, h, weights, picks)
        got = handover.add(kernels.moe_gathered(cache, i, lay, h, weights, own, ws.w_gate_up, ws.w_down))
        alone = kernels.moe_gathered(cache, i, lay, h, weights, picks, ws.w_gate_up, ws.w_down)
        torch.cuda.synchronize()
        host = {int(e) for e in picks.reshape(-1).tolist()} - {int(e) for e in own.reshape(-1).tolist() if e >= 0}
        assert host == want_host and float(handover.carry) == pytest.approx(want_carry, abs=1e-6), rep
        assert torch.equal(own >= 0, ~torch.isin(picks, torch.tensor(sorted(host), device=CUDA))), rep
        assert handover.mailbox.status == 0 and handover.worker.error is None
        assert rel_err(got, alone) <= LAYER_TOL, rep
    assert handover.worker.counter.rate.calls >= 1
    handover.close()


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_with_the_hand_over_agrees_with_the_reference(tiny_gguf, graphs):
    """Prefill then decode steps with every missing expert on the host's cores, eager or replayed as
    CUDA graphs (the hand-over's kernels inside them): logits near the fp32 reference's, and the host
    answered a request for each layer of each step."""
    f, spec, stage = stage_with(tiny_gguf, "1", cuda_graphs=graphs)
    handover = stage.experts.handover
    assert isinstance(handover, CpuHandover)
    ref = load_reference_runner(f, spec)
    torch.manual_seed(5)
    prompt = torch.randint(0, spec.vocab_size, (12,))
    kv_s, kv_r = stage.new_sequence(64), ref.new_sequence(64)
    a, b = ref.prefill(kv_r, prompt), stage.prefill(kv_s, prompt)
    token = torch.tensor([int(a.argmax())])
    before = handover.worker.counter.rate.calls
    steps = 5
    for step in range(steps):
        a, b = ref.decode([kv_r], token)[0], stage.decode([kv_s], token)[0].cpu()
        assert torch.isfinite(b).all() and rel_err(b, a) <= STEP_TOL, step
        token = torch.tensor([int(a.argmax())])
    torch.cuda.synchronize()
    answered = handover.worker.counter.rate.calls - before
    assert answered >= steps * spec.n_layers * 0.9  # 6 of 8 miss: nearly every layer asks
    assert bool(stage.graphs.captured) == graphs
    handover.close()


def test_a_failing_host_is_detached_and_decode_goes_on_over_the_link(tiny_gguf):
    """A worker whose executor raises answers with zeros and sets the share to 0 (later layers give
    it nothing); the next step detaches the hand-over and decodes over the link alone, as the stage
    without one does."""
    f, spec, stage = stage_with(tiny_gguf, "1", cuda_graphs=False)
    handover = stage.experts.handover
    assert isinstance(handover, CpuHandover)

    class Failing:
        name, threads = "failing", 1

        def moe(self, *args, **kwargs):
            raise RuntimeError("boom")

        def describe(self):
            return "failing"

        def close(self):
            pass

    handover.worker.executor = Failing()
    kv = stage.new_sequence(32)
    stage.prefill(kv, torch.arange(4))
    assert stage.silent_faults() == 0
    out = stage.decode([kv], torch.tensor([1]))  # the host answers with zeros and keeps the error
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and handover.worker.error is not None and handover.share_value == 1.0
    assert float(handover.mailbox.share_np[0]) == 0.0
    assert stage.silent_faults() == 1  # the step went on without the host's part: the engine fails its requests
    out = stage.decode([kv], torch.tensor([2]))
    assert stage.experts.handover is None and torch.isfinite(out).all()
    assert stage.silent_faults() == 1  # counted still, the hand-over detached


def test_auto_measures_both_rates_and_says_what_it_chose(tiny_gguf, caplog):
    caplog.set_level("INFO", logger="strata.stage")
    f, spec, stage = stage_with(tiny_gguf, "auto")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--cpu-experts auto takes" in said and "GB/s" in said
    handover = stage.experts.handover
    if handover is not None:
        assert 0.1 <= handover.share_value <= 1
        handover.close()


@pytest.mark.parametrize("share", ["0.5", "1"])
def test_a_few_row_prompt_with_the_host_helping_agrees_with_the_reference(tiny_gguf, share):
    """A 24-token prompt streams whole layers: the host's cores take the share of each layer's
    streamed experts (HostPrefillHelper: handover_rows, handover_send with the fixed choice, the
    sums collected after the GPU's own part), the ring uploads the rest; logits near the reference's."""
    f, spec, stage = stage_with(tiny_gguf, share, host_prompt_help=True)
    handover, helper = stage.experts.handover, stage.experts.host_helper
    assert isinstance(handover, CpuHandover) and helper is not None
    ref = load_reference_runner(f, spec)
    torch.manual_seed(6)
    prompt = torch.randint(0, spec.vocab_size, (24,))
    before = handover.worker.counter.rate.calls
    a = ref.prefill(ref.new_sequence(64), prompt)
    b = stage.prefill(stage.new_sequence(64), prompt).cpu()
    torch.cuda.synchronize()
    assert helper.n_experts == round(float(share) * (spec.n_experts - 2))
    assert 0 < handover.worker.counter.rate.calls - before <= spec.n_layers  # a layer whose host experts were picked
    assert torch.isfinite(b).all() and rel_err(b, a) <= STEP_TOL
    handover.close()
