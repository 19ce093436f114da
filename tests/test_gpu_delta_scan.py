"""fla-core's chunked gated delta rule (kernels/delta_rule.py) against the plain scan it replaces on a
GPU stage (`model.delta_net.delta_rule_chunked`), on fresh random inputs of Qwen3.5-35B-A3B's head
shapes (32 value heads of 128, a state carried in), and a hybrid stage's prompt through each (marker
`gpu`; skipped without CUDA, or where fla-core is not installed)."""

from __future__ import annotations

import gc

import pytest
import torch

from strata_mgpu.config import StageSwitches
from strata_mgpu.kernels.delta_rule import fla_delta_scan
from strata_mgpu.kernels.paths import PathCounter
from strata_mgpu.model.delta_net import delta_rule_chunked, l2norm
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from tests.test_gpu import _share_routing

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
# fp32 inputs both; fla's dots may run as TF32 (10-bit mantissas) where the scan's run in fp32:
# max|diff| / max|ref| of the outputs and the state
SCAN_TOL = 5e-3


def _inputs(t: int, heads: int, dk: int, dv: int, seed: int):
    g = torch.Generator(device=CUDA).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=CUDA)

    q = l2norm(rand(t, heads, dk)) * dk ** -0.5
    k = l2norm(rand(t, heads, dk))
    v = rand(t, heads, dv)
    decay = -torch.nn.functional.softplus(rand(t, heads)) * 0.5  # log decays <= 0
    beta = torch.sigmoid(rand(t, heads))
    state = rand(heads, dk, dv) * 0.1
    return q, k, v, decay, beta, state


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module")
def scan():
    got = fla_delta_scan(CUDA, PathCounter())
    if got is None:
        pytest.skip("fla-core is not installed (pip install fla-core)")
    return got


@pytest.mark.parametrize("t", [2, 63, 64, 300, 4096])
def test_fla_scan_equals_the_plain_scan(scan, t):
    q, k, v, g, beta, state = _inputs(t, 32, 128, 128, seed=t)
    want_out, want_state = delta_rule_chunked(q, k, v, g, beta, state.clone())
    got_out, got_state = scan(q, k, v, g, beta, state.clone())
    assert got_out.shape == want_out.shape and got_state.shape == want_state.shape
    assert _rel(got_out, want_out) <= SCAN_TOL and _rel(got_state, want_state) <= SCAN_TOL


def test_a_scan_continued_from_its_state_equals_one_scan(scan):
    """300 tokens as 130 then 170, the second from the first's state: what a chunked prompt does."""
    q, k, v, g, beta, state = _inputs(300, 32, 128, 128, seed=1)
    whole, whole_state = scan(q, k, v, g, beta, state.clone())
    first, mid = scan(q[:130], k[:130], v[:130], g[:130], beta[:130], state.clone())
    second, end = scan(q[130:], k[130:], v[130:], g[130:], beta[130:], mid)
    assert _rel(torch.cat([first, second]), whole) <= SCAN_TOL and _rel(end, whole_state) <= SCAN_TOL


@torch.no_grad()
def test_a_hybrid_stage_prompt_through_fla_equals_it_through_the_plain_scan(scan, tiny_hybrid_gguf):
    """Two bf16 stages, one scanning by fla and one by the plain scan, the second made to pick the
    experts the first picked (fla's TF32 dots move a router's near tie otherwise: 0.17 of the logits
    seen free, with the scans themselves 1.8e-3 apart on the stage's own inputs)."""
    f = GGUFFile(tiny_hybrid_gguf)
    spec = spec_from_gguf(f)
    prompt = torch.randint(0, spec.vocab_size, (200,), generator=torch.Generator().manual_seed(2))
    gc.collect()
    stages = {how: build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=4, switches=StageSwitches(
        cuda_graphs=False, delta_scan=how))) for how in ("fla", "torch")}
    _share_routing(stages["fla"], stages["torch"])
    logits = {how: stage.prefill(stage.new_sequence(256), prompt).float().cpu() for how, stage in stages.items()}
    for how, stage in stages.items():  # each linear layer's prompt rows through fla, or none
        assert (stage.kernels.paths["delta_scan:fla"] > 0) == (how == "fla")
    assert _rel(logits["fla"], logits["torch"]) <= 2e-2
