"""`strata sweep`: one-chunk prefill speed for each helper share and prompt length.

Each cell is the median tok/s of `runs` one-chunk prefills with the helper's share fixed (0:
help off); the table gives the gain over help-off, the best share per length, and marks the
share the default rule would take (`runtime.help_rule.default_share`). Writes CSV, JSON and a
PNG plot (matplotlib, when installed). Runs on the CPU with the tiny model and two emulated
stages too; there both stages share the same cores and no link is streamed, so those figures
say nothing about what a second card's link brings.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from strata_mgpu.split.help_rule import HelpPolicy, default_share
from strata_mgpu.tools.bench import sync_stages


@dataclass
class SweepCell:
    tokens: int
    share: float
    tok_per_s: float  # median
    runs_s: list[float] = field(default_factory=list)


@dataclass
class SweepResult:
    devices: str
    model: str
    cells: list[SweepCell]

    def cell(self, tokens: int, share: float) -> SweepCell:
        return next(c for c in self.cells if c.tokens == tokens and c.share == share)

    def lengths(self) -> list[int]:
        return sorted({c.tokens for c in self.cells})

    def shares(self) -> list[float]:
        return sorted({c.share for c in self.cells})

    def gain(self, tokens: int, share: float) -> float:
        """tok/s relative to help-off at the same length (share 0 must be in the sweep)."""
        return self.cell(tokens, share).tok_per_s / self.cell(tokens, 0.0).tok_per_s - 1.0

    def best_share(self, tokens: int) -> float:
        return max(self.shares(), key=lambda s: self.cell(tokens, s).tok_per_s)

    @staticmethod
    def rule_share(tokens: int) -> float:
        return default_share(tokens)


def run_sweep(runner, model_name: str, lengths: list[int], shares: list[float], runs: int,
              on_cell=lambda cell: None) -> SweepResult:
    """Time every (length, share) cell; the runner must be a split runner with helpers set."""
    if not getattr(runner, "helpers", None):
        raise ValueError("the sweep needs two or more stages (--devices 0,1, 0,0 or cpu,cpu)")
    g = torch.Generator().manual_seed(0)
    cells = []
    saved = runner.policy
    try:
        for n in lengths:
            prompt = torch.randint(0, runner.spec.vocab_size, (n,), generator=g)
            runner.policy = HelpPolicy(enabled=False)
            runner.prefill(runner.new_sequence(n + 1), prompt, whole_prompt=True)  # warm-up for this length
            for share in shares:
                runner.policy = HelpPolicy(enabled=share > 0, fixed_share=share if share > 0 else None)
                times = []
                for _ in range(runs):
                    kv = runner.new_sequence(n + 1)
                    sync_stages(runner.stages)
                    t0 = time.perf_counter()
                    runner.prefill(kv, prompt, whole_prompt=True)
                    sync_stages(runner.stages)
                    times.append(time.perf_counter() - t0)
                cell = SweepCell(tokens=n, share=share, tok_per_s=n / statistics.median(times), runs_s=times)
                cells.append(cell)
                on_cell(cell)
    finally:
        runner.policy = saved
    return SweepResult(devices=",".join(str(s.ctx.device) for s in runner.stages), model=model_name, cells=cells)


def write_csv(result: SweepResult, path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["tokens", "share", "tok_per_s", "gain_over_off", "rule_share", "best_share"])
        for c in result.cells:
            w.writerow([c.tokens, c.share, f"{c.tok_per_s:.1f}", f"{result.gain(c.tokens, c.share):.4f}",
                        result.rule_share(c.tokens), result.best_share(c.tokens)])


def write_json(result: SweepResult, path: Path) -> None:
    data = asdict(result) | {"best_share": {n: result.best_share(n) for n in result.lengths()},
                             "rule_share": {n: result.rule_share(n) for n in result.lengths()}}
    path.write_text(json.dumps(data, indent=2))


def write_png(result: SweepResult, path: Path) -> bool:
    """Gain over help-off against share, one line per length. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in result.lengths():
        shares = result.shares()
        ax.plot(shares, [100 * result.gain(n, s) for s in shares], marker="o", label=f"{n:,} tokens")
        rule = result.rule_share(n)
        if rule > 0:
            ax.axvline(rule, color=ax.lines[-1].get_color(), linestyle=":", linewidth=1)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("helper's share of each layer's experts")
    ax.set_ylabel("prefill tok/s gain over help-off (%)")
    ax.set_title(f"{result.model} on {result.devices} (dotted: the rule's share)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
