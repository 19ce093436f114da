"""Run a `strata bench` command with the CUDA allocator's history on, and say what holds the memory.

    python3 scripts/oom_probe.py OUT_DIR -- bench MODEL --max-vram 16 ...

At the first out-of-memory error (and once more at the end) it writes OUT_DIR/oom_*.txt: the
live blocks grouped by the innermost strata_mgpu frame that allocated them, largest first, with
torch's allocated / reserved figures. A diagnosis tool for tight budgets, not part of the product.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch


def summary(title: str) -> str:
    snap = torch.cuda.memory._snapshot()
    by_site: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for seg in snap["segments"]:
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or []
            ours = [f for f in frames if "strata_mgpu" in f["filename"]]
            site = (f"{Path(ours[0]['filename']).name}:{ours[0]['line']} {ours[0]['name']}" if ours
                    else (f"{Path(frames[0]['filename']).name}:{frames[0]['line']}" if frames else "?"))
            by_site[site][0] += block["size"]
            by_site[site][1] += 1
    lines = [title, f"allocated {torch.cuda.memory_allocated() / 2**30:.3f} GiB, reserved "
             f"{torch.cuda.memory_reserved() / 2**30:.3f} GiB, peak {torch.cuda.max_memory_allocated() / 2**30:.3f}"]
    for site, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:40]:
        lines.append(f"{size / 2**20:10.1f} MiB {n:6d} blocks  {site}")
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[sys.argv.index("--") + 1:]
    from strata_mgpu.env import default_allocator_config

    default_allocator_config()  # as the CLI does, before the first CUDA allocation
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    seen = {"n": 0}

    def on_oom(device, alloc, device_alloc, device_free):  # the allocator's callback, before it raises
        seen["n"] += 1
        if seen["n"] <= 3:
            path = out / f"oom_{seen['n']}.txt"
            path.write_text(summary(f"OOM #{seen['n']} on device {device}: asked {alloc / 2**20:.1f} MiB, "
                                    f"device allocated {device_alloc / 2**30:.3f} GiB, free {device_free / 2**30:.3f}"))
            print(path.read_text(), file=sys.stderr)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    from strata_mgpu.cli import main as cli

    try:
        cli(args, standalone_mode=False)
    except BaseException as e:  # noqa: BLE001 - a diagnosis: report, then the end state
        print(f"bench ended with {type(e).__name__}: {e}", file=sys.stderr)
    (out / "oom_end.txt").write_text(summary("at the end"))
    print((out / "oom_end.txt").read_text(), file=sys.stderr)


if __name__ == "__main__":
    main()
