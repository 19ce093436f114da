"""Decode speed with the expert cache held still (the first K experts of every layer: K / E hits
under uniform routing) and with it following the routing.

    python3 -m strata_mgpu.tools.decode_cache MODEL.gguf [--max-vram 16] [--tokens 64] [--sequences 3]
"""

from __future__ import annotations

import argparse

import torch

from strata_mgpu import env
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.residency import Residency
from strata_mgpu.stage.stage import StageOptions
from strata_mgpu.tools.bench import time_decode


def main() -> None:
    environment = env.read_or_exit()  # every STRATA_* variable, checked at start-up
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--max-vram", type=float, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sequences", type=int, default=3)
    args = ap.parse_args()
    f = GGUFFile(args.model)
    opts = StageOptions.from_env(environment, device=torch.device("cuda", 0), max_vram_gib=args.max_vram)
    stage = build_stage(f, spec_from_gguf(f), opts)
    cache = stage.experts.cache
    if cache is None:
        raise SystemExit("this stage keeps no experts resident: nothing to compare")
    following, stage.refill = stage.refill, Residency(None)  # held still: the first K experts a layer
    for i in range(args.sequences):
        tps, hit, _ = time_decode(stage, args.tokens, seed=i)
        assert hit is not None  # the stage has an expert cache
        print(f"static cache ({cache.per_layer} experts a layer), sequence {i}: {tps:.1f} tok/s, "
              f"{100 * hit:.0f}% of picks from VRAM")
    stage.refill = following
    for i in range(args.sequences):
        tps, hit, _ = time_decode(stage, args.tokens, seed=100 + i)
        assert hit is not None
        print(f"cache following the routing, sequence {i}: {tps:.1f} tok/s, {100 * hit:.0f}% of picks from VRAM, "
              f"{cache.swapped} experts moved so far")


if __name__ == "__main__":
    main()
