"""Two-tier KV on the GPU (marker `gpu`; skipped without CUDA): a stage's bf16 forward with the
older prefix in pinned host RAM against the same stage with every cell in VRAM, prefetch on the
side stream on and off; a prompt whose KV is many windows long; a failed forward with an upload
pending on the side stream."""

from __future__ import annotations

import gc

import pytest
import torch

from strata_mgpu.config import StageSwitches
from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_cache import KVCache
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.model.weights import load_weights
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.kv.two_tier import KVStaging, TwoTierKV, make_kv_cache, window_bytes
from strata_mgpu.stage.stage import Stage, StageOptions
from tests.failing_experts import FailingExperts

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
# The keys and values attention reads are the same bits in both tiers and every kernel sees the
# same shapes, so the logits should be equal; the bound leaves room for a kernel that is not
# run-to-run deterministic, well under what a wrong or stale cell moves (O(1) in these models).
BF16_TOL = 1e-2


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module", params=["tiny", "small"])
def stage(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_kv") / f"{request.param}.gguf"
    write_model(path, request.param, seed=5)
    f = GGUFFile(path)
    gc.collect()  # earlier modules' stages must not count against this device's cap
    # No graphs: the captured step reads only VRAM (the stage must check graph_capturable first).
    stage = build_stage(f, spec_from_gguf(f), StageOptions(device=CUDA, max_vram_gib=8,
                                                           switches=StageSwitches(cuda_graphs=False)))
    # Like against like: a plain cache's short chunks would take the fused ops (static_rows) where a
    # spilled one takes run's, and the two paths' bf16 roundings differ by more than the KV's own
    # (~1.5e-2 on the H200); tests/test_gpu.py holds the fused ops to run's path.
    stage.model.static_rows = False
    return stage


def caches(stage: Stage, window: int, max_length: int, staging: KVStaging) -> tuple[KVCache, TwoTierKV]:
    spec, layers = stage.spec, stage.layers
    with stage.ctx.on_compute():
        plain = make_kv_cache(spec, layers, max_length, max_length, device=CUDA, dtype=torch.bfloat16, staging=None)
        two = make_kv_cache(spec, layers, window, max_length, device=CUDA, dtype=torch.bfloat16, staging=staging)
    assert isinstance(plain, KVCache) and isinstance(two, TwoTierKV)
    return plain, two


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_two_tier_equals_all_vram_in_bf16(stage, prefetch):
    """Chunks longer than the window, then batched decode of two spilled sequences sharing one
    staging; no host sync per layer on this path, so the side stream races compute for real."""
    max_length, window = 1200, 100
    staging = KVStaging.for_model(stage.spec, max_length, ctx=stage.ctx, dtype=torch.bfloat16, prefetch=prefetch)
    (plain_a, a), (plain_b, b) = caches(stage, window, max_length, staging), caches(stage, window, max_length,
                                                                                    staging)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prompt_a = torch.randint(0, stage.spec.vocab_size, (900,), generator=g)
    prompt_b = torch.randint(0, stage.spec.vocab_size, (333,), generator=g)
    for prompt, plain, two in ((prompt_a, plain_a, a), (prompt_b, plain_b, b)):
        at = 0
        for n in (256, 37, 300, 1, 306):
            chunk = prompt[at:at + n]
            if chunk.numel() == 0:
                break
            want, got = stage.prefill(plain, chunk), stage.prefill(two, chunk)
            assert rel_err(got, want) <= BF16_TOL, f"chunk at {at}"
            at += chunk.numel()
    assert a.host_rows == [900 - window] * len(stage.layers) and b.spilled
    step = torch.tensor([3, 17])
    for _ in range(6):
        want, got = stage.decode([plain_a, plain_b], step), stage.decode([a, b], step)
        assert rel_err(got, want) <= BF16_TOL
        step = want.argmax(-1).cpu()
    torch.cuda.synchronize()
    assert staging.holds == [None] * staging.n_buffers


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_long_prompt_holds_only_the_window_in_vram(stage, prefetch):
    """A prompt of 7,000 tokens with a 512-cell window: the sequence's VRAM is the window (the
    staging is the stage's, allocated before), the rest sits on the host, and the logits match the
    all-VRAM cache's."""
    spec, n_layers = stage.spec, len(stage.layers)
    max_length, window, n = 7100, 512, 7000
    staging = KVStaging.for_model(spec, max_length, ctx=stage.ctx, dtype=torch.bfloat16, prefetch=prefetch)
    prompt = torch.randint(0, spec.vocab_size, (n,))
    with stage.ctx.on_compute():  # lazy workspaces (cuBLAS, ...) of the first forward are not the KV's
        warm = make_kv_cache(spec, stage.layers, 64, 64, device=CUDA, dtype=torch.bfloat16, staging=None)
    stage.prefill(warm, prompt[:64])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    with stage.ctx.on_compute():
        two = make_kv_cache(spec, stage.layers, window, max_length, device=CUDA, dtype=torch.bfloat16,
                            staging=staging)
    got = [stage.prefill(two, prompt[i:i + 2048]) for i in range(0, n, 2048)]
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(CUDA) - before
    assert two.nbytes == window_bytes(spec, n_layers, window)
    assert grown <= two.nbytes + 2**20, f"{grown} bytes stayed allocated; the window is {two.nbytes}"
    assert two.host_rows == [n - window] * n_layers and two.host_k.is_pinned()
    with stage.ctx.on_compute():
        plain = make_kv_cache(spec, stage.layers, max_length, max_length, device=CUDA, dtype=torch.bfloat16,
                              staging=None)
    want = [stage.prefill(plain, prompt[i:i + 2048]) for i in range(0, n, 2048)]
    for w, g_ in zip(want, got, strict=True):
        assert rel_err(g_, w) <= BF16_TOL
    token = torch.tensor([int(want[-1].argmax())])
    assert rel_err(stage.decode([two], token), stage.decode([plain], token)) <= BF16_TOL


@torch.no_grad()
def test_failed_forward_drains_the_side_stream(tmp_path_factory):
    """bf16 oracle on the GPU: a chunk fails in layer 1 with layer 2's upload queued on the side
    stream; the other sequence and the failed one, retried, match all-VRAM caches."""
    path = tmp_path_factory.mktemp("gpu_kv_fail") / "tiny.gguf"
    write_model(path, "tiny", seed=9)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    model = ReferenceModel(spec, load_weights(f, spec, dtype=torch.bfloat16, device=CUDA))
    model.experts = experts = FailingExperts(model.experts)
    ctx = DeviceContext(CUDA, 8 * 2**30)  # the model runs on the caller's stream: only the side stream is ctx's
    staging = KVStaging.for_model(spec, 800, ctx=ctx, dtype=torch.bfloat16, prefetch=True)
    layers, window = range(spec.n_layers), 64

    def make(cells):
        return make_kv_cache(spec, layers, cells, 800, device=CUDA, dtype=torch.bfloat16, staging=staging)

    a, b, plain_a, plain_b = make(window), make(window), make(800), make(800)
    pa, pb = (torch.randint(0, spec.vocab_size, (n,), device=CUDA) for n in (700, 500))

    def logits(tokens, kv):
        return model.logits(model.forward(tokens, [Segment(0, tokens.shape[0], kv)]))

    for kv, plain, p in ((a, plain_a, pa[:300]), (b, plain_b, pb[:300])):
        assert rel_err(logits(p, kv), logits(p, plain)) <= BF16_TOL
    experts.fail_layer = 1
    with pytest.raises(RuntimeError, match="injected failure"):
        logits(pa[300:], a)
    assert staging.holds == [None, None] and a.length == 300
    assert rel_err(logits(pb[300:], b), logits(pb[300:], plain_b)) <= BF16_TOL
    assert rel_err(logits(pa[300:], a), logits(pa[300:], plain_a)) <= BF16_TOL
    a.close()
    step = torch.tensor([7], device=CUDA)
    assert rel_err(logits(step, b), logits(step, plain_b)) <= BF16_TOL
