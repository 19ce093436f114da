"""Profile one-chunk prefill on the GPU: where does a prompt's time go when little or nothing
streams?

    python3 -m strata_mgpu.tools.profile_prefill MODEL.gguf [--max-vram 40] [--tokens 2048] > profile.txt

`--no-static-rows` keeps a short prompt on `Decoder.run`'s eager ops, to compare with the fused
ops it takes by default.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from strata_mgpu import env
from strata_mgpu.config import StageSwitches
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions


def main() -> None:
    environment = env.read_or_exit()  # every STRATA_* variable, checked at start-up
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--max-vram", type=float, default=40)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--resident-experts", type=int, default=None, help="force K resident a layer (0: none)")
    ap.add_argument("--no-static-rows", action="store_true",
                    help="short prompts through run's eager ops, not the decode step's fused ones (static_rows)")
    args = ap.parse_args()
    f = GGUFFile(args.model)
    spec = spec_from_gguf(f)
    opts = StageOptions(device=torch.device("cuda", 0), max_vram_gib=args.max_vram, chunk_size=args.tokens,
                        kv_tokens=args.tokens + 1,
                        switches=StageSwitches.from_env(environment, resident_experts=args.resident_experts))
    stage = build_stage(f, spec, opts)
    stage.model.static_rows &= not args.no_static_rows
    prompt = torch.randint(0, spec.vocab_size, (args.tokens,))
    for _ in range(2):  # warm-up: kernels, allocator
        stage.prefill(stage.new_sequence(args.tokens + 1), prompt)
    stage.ctx.synchronize_device()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        stage.prefill(stage.new_sequence(args.tokens + 1), prompt)
        stage.ctx.synchronize_device()
        dt = time.perf_counter() - t0
    print(f"{args.tokens} tokens in {1e3 * dt:.1f} ms under the profiler ({args.tokens / dt:,.0f} tok/s), "
          f"{stage.plan.resident_per_layer}/{spec.n_experts} experts a layer resident, static rows "
          f"{'on' if stage.model.static_rows else 'off'}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
