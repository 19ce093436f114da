"""How fast a cached prefix comes back, against its bound and against computing it again: a stage
computes a prompt of N tokens into blocks of its KV pool; a continuation then adopts those blocks
where they still are in VRAM (no copy: the time to adopt is a table's bookkeeping), and takes them
back from pinned host RAM where the prefix cache had moved them (`load` of every block into free ones).

    python3 -m strata_mgpu.tools.prefix_restore MODEL.gguf --tokens 32768 --max-vram 40 [--json out.json]

The bound of the host restore is one pinned host-to-device copy of the same bytes, measured here;
the prompt's prefill time is what either saves.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_pool import BlockTable
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions

REPEATS = 3  # each restore timed this often, the fastest kept


@dataclass
class RestoreResult:
    tokens: int
    block_tokens: int
    bytes: int
    prefill_s: float  # computing the prefix: what a restore saves
    adopt_s: float  # a continuation on the blocks in VRAM: its table and sequence, no copy
    offload_s: float  # the blocks to pinned host RAM (what the cache does as the pool runs dry)
    host_restore_s: float  # the blocks back from pinned host RAM into free blocks of the pool
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
    n_blocks = tokens // block_tokens
    tokens = n_blocks * block_tokens
    context = tokens + block_tokens
    # room for the prefix twice over (its blocks and their copies back from the host) and a continuation's
    stage = build_stage(f, spec, StageOptions(device=torch.device("cuda", 0), max_vram_gib=max_vram, chunk_size=chunk,
                                              kv_tokens=2 * tokens + 4 * block_tokens, context=context))
    pool = stage.kv_pool(block_tokens, 0)
    blocks = pool.blocks
    sync = stage.ctx.synchronize_device
    prompt = torch.randint(0, spec.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))

    def prefill() -> tuple[BlockTable, float]:
        table = BlockTable(blocks, context)
        kv = stage.new_sequence(context, table)
        sync()
        t0 = time.perf_counter()
        for start in range(0, tokens, chunk):
            stage.prefill(kv, prompt[start:start + chunk])
        sync()
        return table, time.perf_counter() - t0

    warm, _ = prefill()
    warm.free()
    table, prefill_s = prefill()
    prefix = table.ids[:n_blocks]

    def adopt() -> float:
        sync()
        t0 = time.perf_counter()
        again = BlockTable.adopt(blocks, context, prefix)
        stage.new_sequence(context, again, tokens)
        sync()
        elapsed = time.perf_counter() - t0
        again.free()
        return elapsed

    adopt_s = min(adopt() for _ in range(REPEATS))
    t0 = time.perf_counter()
    host = [pool.offload(b) for b in prefix]
    sync()
    offload_s = time.perf_counter() - t0

    def restore() -> float:
        sync()
        t0 = time.perf_counter()
        into = blocks.allocate(n_blocks)
        for data, b in zip(host, into, strict=True):
            pool.load(data, b)
        sync()
        elapsed = time.perf_counter() - t0
        blocks.unref(into)
        return elapsed

    restore()  # warm-up
    host_s = min(restore() for _ in range(REPEATS))
    nbytes = n_blocks * pool.block_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=stage.ctx.device)
    times = []
    for _ in range(REPEATS):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        times.append(time.perf_counter() - t0)
    table.free()
    return RestoreResult(tokens=tokens, block_tokens=block_tokens, bytes=nbytes, prefill_s=prefill_s, adopt_s=adopt_s,
                         offload_s=offload_s, host_restore_s=host_s, h2d_bound_s=min(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--max-vram", type=float, default=None)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.tokens < args.block_tokens or args.block_tokens < 1 or args.chunk < 1:
        ap.error(f"--tokens {args.tokens} must hold at least one block of --block-tokens {args.block_tokens}, "
                 f"--chunk at least 1")
    r = measure(args.model, args.tokens, args.max_vram, args.block_tokens, args.chunk)
    print(f"{r.tokens:,}-token prefix, {r.bytes / 1e9:.2f} GB of KV in blocks of {r.block_tokens}: computed in "
          f"{r.prefill_s:.2f} s; continued on its VRAM blocks in {1e3 * r.adopt_s:.2f} ms (no copy); moved to "
          f"pinned host RAM in {1e3 * r.offload_s:.1f} ms and back in {1e3 * r.host_restore_s:.1f} ms "
          f"({r.host_gb_per_s:.1f} GB/s, {r.host_gb_per_s / r.bound_gb_per_s:.2f} of one pinned copy's "
          f"{r.bound_gb_per_s:.1f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(r), "host_gb_per_s": r.host_gb_per_s, "bound_gb_per_s": r.bound_gb_per_s}, f, indent=2)


if __name__ == "__main__":
    main()
