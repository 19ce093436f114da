"""What a newcomer sees first: where `strata serve` runs the model (device, dtype, kernels, the VRAM
plan on a GPU), the chunk resolved against the context, the hint for a CPU build of torch on a GPU
machine, and a directory given as the model refused like any file that cannot be opened."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from strata_mgpu.cli import main
from strata_mgpu.config import EngineConfig, Placement, ServerConfig
from strata_mgpu.engine.build import build_runner, preview_plans
from strata_mgpu.kernels.cpu_experts import ggml_missing
from strata_mgpu.kernels.experts import CudaKernels, TorchKernels
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.server import launch
from strata_mgpu.stage.device import DeviceError
from strata_mgpu.stage.memory_plan import vram_plan_line
from strata_mgpu.stage.stage import Stage
from tests.server_proc import running_server


def test_chunk_is_resolved_against_the_context():
    assert EngineConfig(chunk_size=8192).for_model(4096) == EngineConfig(ctx_size=4096, chunk_size=4096)
    assert EngineConfig(ctx_size=1024, chunk_size=8192).for_model(4096).chunk_size == 1024
    assert EngineConfig(ctx_size=100_000, chunk_size=512).for_model(4096) == EngineConfig(ctx_size=4096,
                                                                                          chunk_size=512)


def test_where_the_reference_and_cpu_stages_run(tiny_gguf, monkeypatch):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    # serve's runner on one CPU device where ggml-python is missing (with it: a CPU stage, tests/test_cpu_experts.py)
    monkeypatch.setattr("strata_mgpu.engine.build.ggml_missing", lambda: "ggml-python is not installed")
    reference = build_runner(f, spec, Placement(devices=("cpu",)), 64, cpu_reference=True)
    said = reference.describe()  # the facts a user reads in the start-up line: where, how precise, which forward
    assert said.startswith("cpu") and "fp32" in said and "reference" in said and "host RAM" in said, said
    split = build_runner(f, spec, Placement(devices=("cpu", "cpu")), 64, kv_tokens=256)
    stages = split.describe().split(" | ")  # each stage's layers and device, in order
    assert split.describe().startswith("2 stages") and len(stages) == 2, stages
    for stage, layers in zip(stages, ("layers 0-1 ", "layers 2-3 "), strict=True):
        assert layers in stage and "on cpu" in stage and "fp32" in stage, stage


def test_vram_plan_in_one_line(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    ((_, layers, plan),) = preview_plans(f, spec, Placement(devices=("cuda:0",), max_vram_gib=(1.0,)), 4096, 4096)
    line = vram_plan_line(plan, pass_bytes=123_000_000)
    assert line.startswith(f"VRAM plan {plan.total / 2**30:.1f} of 1.0 GiB: {plan.resident_per_layer}/8 experts a "
                           f"layer resident ("), line
    assert line.endswith("a prompt pass streams 0.12 GB, KV 4,096 tokens in VRAM"), line


def test_where_a_gpu_stage_runs(tiny_gguf):
    """The GPU's line from a stage's parts (no GPU here: the stage is a stand-in with its fields)."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    ((_, layers, plan),) = preview_plans(f, spec, Placement(devices=("cuda:0",), max_vram_gib=(1.0,)), 4096, 4096)
    cuda = CudaKernels.__new__(CudaKernels)  # what select_kernels makes once CuPy compiled the kernels
    cuda.use_grouped_mm = True

    def stage(kernels):
        one = SimpleNamespace(kernels=kernels, layers=layers, plan=plan, report=SimpleNamespace(pass_bytes=10**8),
                              ctx=SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0)),
                              model=SimpleNamespace(w=SimpleNamespace(dtype=torch.bfloat16)))
        return one

    plan_line = vram_plan_line(plan, 10**8)
    assert Stage.describe(stage(cuda)) == (
        f"cuda:0 in bf16 with CUDA kernels (CuPy/NVRTC, grouped GEMM by torch._grouped_mm); {plan_line}")
    assert Stage.describe(stage(TorchKernels())) == (
        f"cuda:0 in bf16 with the torch twins of the CUDA kernels (no CuPy: slower; pip install "
        f"'strata-mgpu[cuda12]'); {plan_line}")


def test_info_plans_the_chunk_serve_plans(tiny_gguf):
    """`info --max-vram` previews what serve plans: a chunk longer than the context is cut to it."""
    args = ["info", str(tiny_gguf), "--max-vram", "1", "--devices", "cuda:0"]
    longer, context = (CliRunner().invoke(main, [*args, "--chunk-size", n]) for n in ("8192", "4096"))
    assert longer.exit_code == context.exit_code == 0, longer.output
    assert "activations (one chunk)" in longer.output and longer.output == context.output


def test_a_cuda_device_with_a_cpu_build_of_torch_gets_the_hint(tiny_gguf, monkeypatch):
    monkeypatch.setattr(launch, "cuda_build_hint", lambda: "torch is a CPU build; install a CUDA build")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = ServerConfig(model_path=tiny_gguf, placement=Placement(devices=("cuda:0",)))
    with pytest.raises(DeviceError, match=r"^cuda:0 was asked for, but torch sees no CUDA device: torch is a CPU "
                                          r"build; install a CUDA build$"):
        launch.serve(config)


@pytest.mark.parametrize("cuda_version, nvidia, hinted", [
    (None, True, True), ("12.8", True, False), (None, False, False)])
def test_a_cpu_build_of_torch_on_a_gpu_machine_gets_the_hint(tiny_gguf, monkeypatch, cuda_version, nvidia, hinted):
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if nvidia else None)
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: False if str(p) == "/dev/nvidia0" else real_exists(p))
    hint = launch.cuda_build_hint()
    assert (hint is not None and hint.startswith("torch is a CPU build; install a CUDA build to use the GPU")) == hinted
    spec = spec_from_gguf(GGUFFile(tiny_gguf))
    warnings = launch.config_warnings(ServerConfig(model_path=tiny_gguf), spec)  # --devices auto: the CPU here
    assert warnings == ([f"serving on the CPU: {hint}"] if hinted else [])
    explicit_cpu = ServerConfig(model_path=tiny_gguf, placement=Placement(devices=("cpu",)))
    assert launch.config_warnings(explicit_cpu, spec) == []  # asked for: nothing to hint


def test_the_demo_says_where_it_runs_and_its_chunk(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    log = tmp_path / "serve.log"
    with running_server([], log):
        pass
    text = log.read_text()
    where = ("model strata-demo runs on cpu in fp32: the torch reference forward" if ggml_missing() is not None else
             "model strata-demo runs on cpu in fp32 with plain torch ops, experts from their GGUF bytes by ggml on ")
    # the CPU's chunk (CPU_CHUNK), not the GPU's 8192 cut to the context: a request arriving during a long
    # prompt waits for a chunk
    ready = "model strata-demo ready: 4 layers, 8 experts (2 used), context 4096, chunk 1024 (loaded in "
    assert where in text and ready in text, text
    assert text.count("INFO strata.server: loading ") == 1 and " ERROR " not in text, text  # polled /health: no errors
    assert "writing the demo model" in text and "gguf_writer" not in text, text  # the writer's own lines are noise


@pytest.mark.parametrize("command", ["serve", "info", "bench", "sweep"])
def test_a_directory_as_the_model_is_a_one_line_error(tmp_path, command):
    missing = CliRunner().invoke(main, [command, str(tmp_path / "missing.gguf")])
    assert missing.exit_code == 1 and missing.stderr.splitlines() == [
        f"Error: {tmp_path / 'missing.gguf'}: cannot open: No such file or directory"], missing.output
    r = CliRunner().invoke(main, [command, str(tmp_path)])
    assert r.exit_code == 1 and r.stderr.splitlines() == [f"Error: {tmp_path}: cannot open: Is a directory"], r.output


def test_the_request_line_shows_a_rate_only_where_there_is_one():
    from strata_mgpu.engine.output import request_line
    from strata_mgpu.engine.request import Timings

    def line(**t) -> str:
        return request_line(SimpleNamespace(id="r", timings=Timings(**t)), "length")

    one = line(prompt_n=1, prompt_ms=0.4, predicted_n=1, predicted_ms=0.1)
    assert "tok/s" not in one and "decode 1 tok 0.1 ms," in one  # one token: the prompt drew it
    many = line(cache_n=64, prompt_n=500, prompt_ms=50.0, predicted_n=20, predicted_ms=100.0)
    assert "prompt 500 tok (+64 cached) 50.0 ms (10000.0 tok/s)" in many
    assert "decode 20 tok 100.0 ms (200.0 tok/s)" in many


def test_the_decode_rate_metric_says_it_is_a_batch_rate():
    from strata_mgpu.engine.metrics import EngineMetrics

    text = EngineMetrics().render().decode()
    assert "# HELP strata_decode_tokens_per_second" in text and "batch rate" in text
