"""`strata sweep`: one-chunk prefill speed for each helper share and prompt length.

Each cell is the median tok/s of `runs` one-chunk prefills with the helper's share fixed (0:
help off), beside the rule's share and `auto`'s picks with their measured speed, and the link
bounds per length. On the CPU both emulated stages share the same cores and no link is measured,
so those figures say nothing about what a second card's link brings.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from strata_mgpu.split.help_rule import HelpPolicy, default_share
from strata_mgpu.split.rate_model import ComputeRates, RateEstimate, StageLoad, best_share, link_bounds, stage_load
from strata_mgpu.split.runner import SplitRunner
from strata_mgpu.stage.stage import Stage
from strata_mgpu.tools.bench import sync_stages

TimePrompt = Callable[[int, HelpPolicy], float]  # (tokens, policy) -> seconds of one one-chunk prefill


@dataclass
class SweepCell:
    tokens: int
    share: float
    tok_per_s: float  # median
    runs_s: list[float] = field(default_factory=list)


@dataclass
class AutoCell:
    tokens: int
    shares: list[float]  # what auto picked, one per busy stage
    tok_per_s: float  # median
    runs_s: list[float] = field(default_factory=list)


@dataclass
class SweepResult:
    devices: str
    model: str
    cells: list[SweepCell]
    auto: list[AutoCell] = field(default_factory=list)
    loads: list[StageLoad] = field(default_factory=list)  # the rate model's inputs, one per busy stage
    across_cards: list[bool] = field(default_factory=list)  # helper and busy stage on different cards
    rates: ComputeRates = field(default_factory=ComputeRates)

    def cell(self, tokens: int, share: float) -> SweepCell:
        return next(c for c in self.cells if c.tokens == tokens and c.share == share)

    def auto_cell(self, tokens: int) -> AutoCell | None:
        return next((c for c in self.auto if c.tokens == tokens), None)

    def lengths(self) -> list[int]:
        return sorted({c.tokens for c in self.cells})

    def shares(self) -> list[float]:
        return sorted({c.share for c in self.cells})

    def gain(self, tokens: int, share: float) -> float:
        """tok/s relative to help-off at the same length (share 0 must be in the sweep)."""
        return self.cell(tokens, share).tok_per_s / self.cell(tokens, 0.0).tok_per_s - 1.0

    def auto_gain(self, tokens: int) -> float | None:
        a = self.auto_cell(tokens)
        return None if a is None else a.tok_per_s / self.cell(tokens, 0.0).tok_per_s - 1.0

    def best_share(self, tokens: int) -> float:
        return max(self.shares(), key=lambda s: self.cell(tokens, s).tok_per_s)

    @staticmethod
    def rule_share(tokens: int) -> float:
        return default_share(tokens)

    def bounds(self, tokens: int) -> tuple[float, float] | None:
        """(unhelped, helped) link bounds of a one-chunk prompt in seconds; None without measured links.
        Stages whose helper shares their card have no second link."""
        if not self.loads or any(x.link_busy is None or x.link_helper is None for x in self.loads):
            return None
        off = helped = 0.0
        for load, across in zip(self.loads, self.across_cards, strict=True):
            o, h = link_bounds(load, tokens)
            off, helped = off + o, helped + (h if across else o)
        return off, helped


def sweep(time_prompt: TimePrompt, lengths: list[int], shares: list[float], runs: int, loads: list[StageLoad],
          across_cards: list[bool], devices: str, model_name: str, rates: ComputeRates | None = None,
          on_cell: Callable[[SweepCell | AutoCell], None] = lambda cell: None) -> SweepResult:
    rates = rates or ComputeRates()
    cells, autos = [], []
    for n in lengths:
        for share in shares:
            policy = HelpPolicy.fixed(share)
            times = [time_prompt(n, policy) for _ in range(runs)]
            cells.append(SweepCell(tokens=n, share=share, tok_per_s=n / statistics.median(times), runs_s=times))
            on_cell(cells[-1])
        policy = HelpPolicy(mode="auto", estimate=RateEstimate(rates))  # fixed rates: no observe here
        picks = [best_share(x, rates, n) if across else 0.0 for x, across in zip(loads, across_cards, strict=True)]
        times = [time_prompt(n, policy) for _ in range(runs)]
        autos.append(AutoCell(tokens=n, shares=picks, tok_per_s=n / statistics.median(times), runs_s=times))
        on_cell(autos[-1])
    return SweepResult(devices=devices, model=model_name, cells=cells, auto=autos, loads=loads,
                       across_cards=across_cards, rates=rates)


def run_sweep(runner: Stage | SplitRunner, model_name: str, lengths: list[int], shares: list[float], runs: int,
              on_cell: Callable[[SweepCell | AutoCell], None] = lambda cell: None) -> SweepResult:
    """Time every cell on a split runner with helpers set (links probed first, on a GPU)."""
    if not isinstance(runner, SplitRunner) or not runner.helpers:
        raise ValueError("the sweep needs two or more stages (--devices 0,1, 0,0 or cpu,cpu)")
    stages = runner.stages
    idles = [stages[(k + 1) % len(stages)] for k in range(len(stages))]
    loads = [stage_load(busy, idle) for busy, idle in zip(stages, idles, strict=True)]
    across = [busy.ctx.device != idle.ctx.device for busy, idle in zip(stages, idles, strict=True)]
    g = torch.Generator().manual_seed(0)
    prompts: dict[int, torch.Tensor] = {}
    saved = runner.policy

    def time_prompt(n: int, policy: HelpPolicy) -> float:
        if n not in prompts:  # a new length: warm up once, help off
            prompts[n] = torch.randint(0, runner.spec.vocab_size, (n,), generator=g)
            runner.policy = HelpPolicy(enabled=False)
            runner.prefill(runner.new_sequence(n + 1), prompts[n], whole_prompt=True)
        runner.policy = policy
        kv = runner.new_sequence(n + 1)
        sync_stages(stages)
        t0 = time.perf_counter()
        runner.prefill(kv, prompts[n], whole_prompt=True)
        sync_stages(stages)
        return time.perf_counter() - t0

    try:
        return sweep(time_prompt, lengths, shares, runs, loads, across,
                     ",".join(str(s.ctx.device) for s in stages), model_name, on_cell=on_cell)
    finally:
        runner.policy = saved


def _shares_text(shares: list[float]) -> str:
    return "/".join(f"{s:.3f}" for s in dict.fromkeys(shares))


def write_csv(result: SweepResult, path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["tokens", "share", "tok_per_s", "gain_over_off", "rule_share", "best_share", "auto_share",
                    "auto_tok_per_s", "bound_off_s", "bound_helped_s"])
        for c in result.cells:
            a, b = result.auto_cell(c.tokens), result.bounds(c.tokens)
            w.writerow([c.tokens, c.share, f"{c.tok_per_s:.1f}", f"{result.gain(c.tokens, c.share):.4f}",
                        result.rule_share(c.tokens), result.best_share(c.tokens),
                        _shares_text(a.shares) if a else "", f"{a.tok_per_s:.1f}" if a else "",
                        f"{b[0]:.4f}" if b else "", f"{b[1]:.4f}" if b else ""])


def write_json(result: SweepResult, path: Path) -> None:
    data = asdict(result) | {"best_share": {n: result.best_share(n) for n in result.lengths()},
                             "rule_share": {n: result.rule_share(n) for n in result.lengths()},
                             "bounds_s": {n: result.bounds(n) for n in result.lengths()}}
    path.write_text(json.dumps(data, indent=2))


def write_png(result: SweepResult, path: Path) -> bool:
    """Gain over help-off against share, one line per length; auto's pick as a star. False when
    matplotlib is missing."""
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
        color = ax.lines[-1].get_color()
        rule = result.rule_share(n)
        if rule > 0:
            ax.axvline(rule, color=color, linestyle=":", linewidth=1)
        a, gain = result.auto_cell(n), result.auto_gain(n)
        if a is not None and gain is not None:
            ax.plot([statistics.mean(a.shares)], [100 * gain], marker="*", markersize=12, color=color)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("helper's share of each layer's experts")
    ax.set_ylabel("prefill tok/s gain over help-off (%)")
    ax.set_title(f"{result.model} on {result.devices} (dotted: the rule's share, star: auto)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def describe(cell: SweepCell | AutoCell) -> str:
    if isinstance(cell, AutoCell):
        return f"{cell.tokens} tokens, auto (share {_shares_text(cell.shares)}): {cell.tok_per_s:,.0f} tok/s"
    return f"{cell.tokens} tokens, share {cell.share:g}: {cell.tok_per_s:,.0f} tok/s"
