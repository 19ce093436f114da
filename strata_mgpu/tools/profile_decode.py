"""Profile a few decode steps of a model on the GPU: where does a token's time go?

    python3 -m strata_mgpu.tools.profile_decode MODEL.gguf [--max-vram 16] [--steps 8] [--batch 1] > profile.txt

With --batch B, B sequences step together (replayed as one graph when STRATA_DECODE_GRAPH_BATCH >= B).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from strata_mgpu import env
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions


def main() -> None:
    environment = env.read_or_exit()  # every STRATA_* variable, checked at start-up
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--max-vram", type=float, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    args = ap.parse_args()
    f = GGUFFile(args.model)
    spec = spec_from_gguf(f)
    opts = StageOptions.from_env(environment, device=torch.device("cuda", 0), max_vram_gib=args.max_vram,
                                 chunk_size=1024)
    stage = build_stage(f, spec, opts)
    b = args.batch
    kvs = [stage.new_sequence(200) for _ in range(b)]
    tokens = torch.randint(0, spec.vocab_size, (64 + 4 + args.steps, b))  # random: see tools/bench time_decode
    for j, kv in enumerate(kvs):
        stage.prefill(kv, tokens[:64, j])
    for i in range(4):
        stage.decode(kvs, tokens[64 + i]).argmax(-1).tolist()
    stage.ctx.synchronize_device()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            stage.decode(kvs, tokens[68 + i]).argmax(-1).tolist()
    dt = (time.perf_counter() - t0) / args.steps
    print(f"batch {b}: {1e3 * dt:.1f} ms a step under the profiler ({b / dt:.1f} tok/s in all)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
