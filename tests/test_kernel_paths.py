"""The path counters of the kernel sets, on the CPU: the twins count what they ran; a CUDA kernel
set whose fast paths do not apply (built here without a GPU) falls back to the twins, counts that
and warns once per reason."""

from __future__ import annotations

import logging

import torch

from strata_mgpu.kernels import experts as K
from strata_mgpu.kernels import paths
from strata_mgpu.kernels.decode_ops import CudaDecodeOps
from strata_mgpu.kernels.paths import PathCounter
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions

CPU = torch.device("cpu")


def cuda_kernels_without_a_gpu() -> K.CudaKernels:
    """A CudaKernels as a card without mapped host memory and without torch._grouped_mm would get
    (no CuPy, no device: every call must take a fallback, and none may launch)."""
    return K.CudaKernels(CPU, K.CardCapabilities(host_pointers=False, grouped_mm=False, grouped_mm_sync_free=False,
                                                 multiprocessors=132))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_cpu_stage_counts_the_twins_paths(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU))
    kv = stage.new_sequence(64)
    logits = stage.prefill(kv, torch.randint(0, spec.vocab_size, (24,)))
    after_prefill = dict(stage.kernels.paths)
    assert after_prefill["dequant:torch"] >= 2 * spec.n_layers  # gate/up and down of every layer
    assert after_prefill["grouped_mlp:loop"] == spec.n_layers
    assert "moe_gathered:twin" not in after_prefill
    for _ in range(3):
        logits = stage.decode([kv], torch.tensor([int(logits.argmax())]))[0]
    assert stage.kernels.paths["moe_gathered:twin"] == 3 * spec.n_layers
    assert stage.kernels.paths["gather_experts:torch"] == 3 * spec.n_layers
    summary = stage.kernels.path_summary()
    assert f"moe_gathered:twin {3 * spec.n_layers}" in summary and "dequant:torch" in summary


def test_cuda_fallbacks_are_counted_and_warned_once(tiny_gguf, monkeypatch, caplog):
    monkeypatch.setattr(paths, "_warned", set())
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU))
    cache, lay = stage.experts.cache, stage.arena.layouts[1]
    k = cuda_kernels_without_a_gpu()
    E, A, D, F = spec.n_experts, spec.n_experts_used, spec.hidden, spec.expert_ffn
    h = torch.randn(2, D)
    experts = torch.stack([torch.randperm(E)[:A] for _ in range(2)])
    weights = torch.softmax(torch.randn(2, A), -1)
    w_gu, w_d = torch.empty(2 * A, 2 * F, D), torch.empty(2 * A, D, F)
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        for _ in range(3):
            got = k.moe_gathered(cache, 1, lay, h, weights, experts, w_gu, w_d)
            a, b = torch.zeros(64), torch.empty(64)
            k.copy_wide(b, a)
    want = K.TorchKernels().moe_gathered(cache, 1, lay, h, weights, experts, w_gu, w_d)
    assert torch.equal(got, want)
    assert k.paths["moe_gathered:twin"] == 3 and k.paths["moe_gathered:fused"] == 0
    assert k.paths["gather_experts:torch"] == 3 and k.paths["grouped_mlp:loop"] == 3
    assert k.paths["dequant:torch"] == 3 * 2 * 2 * A  # twin gather: gate/up and down of each pick
    assert k.paths["copy_wide:copy_engine"] == 3 and k.paths["copy_wide:copy_f32_wide"] == 0
    said = warnings_of(caplog)
    assert len(said) == 5, said  # moe_gathered, gather_experts, dequant, grouped_mlp, copy_wide: once each
    assert any(m.startswith("moe_gathered fell back from fused: activations are torch.float32") for m in said)
    assert any(m.startswith("copy_wide fell back from copy_f32_wide: this device cannot read") for m in said)
    assert any(m.startswith("dequant fell back from cuda: the output is torch.float32") for m in said)


def test_decode_ops_count_twin_calls_and_route_rows_by_gemm(monkeypatch, caplog):
    monkeypatch.setattr(paths, "_warned", set())
    ops = CudaDecodeOps.__new__(CudaDecodeOps)  # no GPU: every call goes to the twin
    shared = PathCounter()
    ops.device, ops.paths = CPU, shared
    x, w = torch.randn(3, 64), torch.ones(64)
    router = torch.randn(8, 64)
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        for _ in range(2):
            ops.rms_norm(x, w, 1e-6)
            ops.route(torch.randn(100, 64), router, 2, True)  # a prompt's rows
            ops.route(x, router, 2, True)
    assert shared["rms_norm:twin"] == 2 and shared["route:gemm"] == 2 and shared["route:twin"] == 2
    said = warnings_of(caplog)
    assert len(said) == 2 and all("not a contiguous bfloat16 CUDA tensor" in m for m in said), said


def test_summary_lists_paths_by_name():
    c = PathCounter()
    assert c.summary() == "none"
    c.ran("dequant", "cuda")
    c.ran("dequant", "cuda")
    c.ran("copy_wide", "copy_f32_wide")
    assert c.summary() == "copy_wide:copy_f32_wide 1, dequant:cuda 2"
