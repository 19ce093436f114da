"""Profile a few decode steps of a model on the GPU: where does a token's time go?

    python3 -m strata_mgpu.tools.profile_decode MODEL.gguf [--max-vram 16] [--steps 8] > profile.txt
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.stage import Stage, StageOptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--max-vram", type=float, default=16)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    f = GGUFFile(args.model)
    spec = spec_from_gguf(f)
    stage = Stage(f, spec, StageOptions(device=torch.device("cuda", 0), max_vram_gib=args.max_vram, chunk_size=1024))
    kv = stage.new_sequence(200)
    tokens = torch.randint(0, spec.vocab_size, (64 + 4 + args.steps, 1))  # random: see tools/bench time_decode
    stage.prefill(kv, tokens[:64, 0])
    for i in range(4):
        int(stage.decode([kv], tokens[64 + i])[0].argmax())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            int(stage.decode([kv], tokens[68 + i])[0].argmax())
    dt = (time.perf_counter() - t0) / args.steps
    print(f"{1e3 * dt:.1f} ms per token under the profiler ({1 / dt:.1f} tok/s)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
