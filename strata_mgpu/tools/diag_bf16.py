"""Where does bf16 error come from? Row-error statistics of several stage variants against the
fp32 reference, on one prompt: GPU with CUDA kernels, GPU with the torch twins, CPU in bf16.

    python3 -m strata_mgpu.tools.diag_bf16 MODEL.gguf
"""

from __future__ import annotations

import sys

import torch

from strata_mgpu import env
from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions


def logits(runner, prompt: torch.Tensor) -> torch.Tensor:
    model = runner.model
    kv = runner.new_sequence(prompt.numel() + 1)
    return model.logits(model.forward(prompt.to(model.device), [Segment(0, prompt.numel(), kv)])).float().cpu()


def main() -> None:
    environment = env.read_or_exit()  # every STRATA_* variable, checked at start-up
    cuda0 = torch.device("cuda", 0)
    f = GGUFFile(sys.argv[1])
    spec = spec_from_gguf(f)
    prompt = torch.randint(0, spec.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
    ref = logits(load_reference_runner(f, spec), prompt)
    variants = {
        "gpu bf16 cuda kernels": StageOptions.from_env(environment, device=cuda0),
        "gpu bf16 torch twins": StageOptions.from_env(environment, device=cuda0, prefer_cuda_kernels=False),
        "gpu fp32 torch twins": StageOptions.from_env(environment, device=cuda0, dtype=torch.float32),
        "cpu bf16 torch twins": StageOptions.from_env(environment, device=torch.device("cpu"), dtype=torch.bfloat16),
    }
    for name, opts in variants.items():
        got = logits(build_stage(f, spec, opts), prompt)
        err = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean()
        print(f"{name:24s} median {err.median():.2e}  p95 {err.quantile(0.95):.2e}  max {err.max():.2e}  "
              f"top-1 {100 * top1:.1f}%")


if __name__ == "__main__":
    main()
