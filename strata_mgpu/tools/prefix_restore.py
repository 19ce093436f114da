"""How fast a cached prefix comes back, against its bound and against computing it again: a stage
computes a prompt of N tokens, its KV is saved as prefix-cache blocks, moved to pinned host RAM,
then loaded into a fresh sequence (the host tier's restore), and once more from VRAM.

    python3 -m strata_mgpu.tools.prefix_restore MODEL.gguf --tokens 32768 --max-vram 40 [--json out.json]

The bound of the host restore is one pinned host-to-device copy of the same bytes, measured here;
the prompt's prefill time is what the restore saves.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_cache import SequenceKV
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions


@dataclass
class RestoreResult:
    tokens: int
    block_tokens: int
    bytes: int
    prefill_s: float
    save_s: float
    host_restore_s: float
    device_restore_s: float
    h2d_bound_s: float  # one pinned copy of the same bytes

    @property
    def host_gb_per_s(self) -> float:
        return self.bytes / self.host_restore_s / 1e9

    @property
    def bound_gb_per_s(self) -> float:
        return self.bytes / self.h2d_bound_s / 1e9


def measure(path: str, tokens: int, max_vram: float | None, block_tokens: int, chunk: int) -> RestoreResult:
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=torch.device("cuda", 0), max_vram_gib=max_vram,
                                              chunk_size=chunk, kv_tokens=tokens + 64, context=tokens + 64))
    sync = stage.ctx.synchronize_device
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, spec.vocab_size, (tokens,), generator=g)
    store = stage.kv_blocks(block_tokens)
    n_blocks = tokens // block_tokens

    def prefill() -> tuple[SequenceKV, float]:
        kv = stage.new_sequence(tokens + 64)
        sync()
        t0 = time.perf_counter()
        for start in range(0, tokens, chunk):
            stage.prefill(kv, prompt[start:start + chunk])
        sync()
        return kv, time.perf_counter() - t0

    prefill()  # warm-up
    kv, prefill_s = prefill()
    t0 = time.perf_counter()
    blocks = [store.save(kv, j) for j in range(n_blocks)]
    sync()
    save_s = time.perf_counter() - t0
    host = [store.offload(b) for b in blocks]
    sync()

    def restore(source: list[torch.Tensor]) -> float:
        fresh = stage.new_sequence(tokens + 64)
        sync()
        t0 = time.perf_counter()
        store.load(fresh, source, n_blocks * block_tokens)
        sync()
        return time.perf_counter() - t0

    restore(host)  # warm-up
    host_s = min(restore(host) for _ in range(3))
    device_s = min(restore(blocks) for _ in range(3))
    nbytes = n_blocks * store.block_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=stage.ctx.device)
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        times.append(time.perf_counter() - t0)
    return RestoreResult(tokens=n_blocks * block_tokens, block_tokens=block_tokens, bytes=nbytes, prefill_s=prefill_s,
                         save_s=save_s, host_restore_s=host_s, device_restore_s=device_s, h2d_bound_s=min(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--max-vram", type=float, default=None)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    r = measure(args.model, args.tokens, args.max_vram, args.block_tokens, args.chunk)
    print(f"{r.tokens:,}-token prefix, {r.bytes / 1e9:.2f} GB of KV in blocks of {r.block_tokens}: computed in "
          f"{r.prefill_s:.2f} s, saved in {1e3 * r.save_s:.1f} ms; restored from pinned host RAM in "
          f"{1e3 * r.host_restore_s:.1f} ms ({r.host_gb_per_s:.1f} GB/s, {r.host_gb_per_s / r.bound_gb_per_s:.2f} of "
          f"one pinned copy's {r.bound_gb_per_s:.1f} GB/s), from VRAM in {1e3 * r.device_restore_s:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(r), "host_gb_per_s": r.host_gb_per_s, "bound_gb_per_s": r.bound_gb_per_s}, f, indent=2)


if __name__ == "__main__":
    main()
