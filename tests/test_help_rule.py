"""HelpPolicy's modes and their controls, and `strata sweep`'s auto column and bounds, timed by a
fake clock (the H200 table of issue #13) so they run without a GPU."""

from __future__ import annotations

import csv
import io
import json

import pytest
from rich.console import Console

from strata_mgpu import env, report
from strata_mgpu.config import Placement
from strata_mgpu.env import EnvError, parse_help_frac
from strata_mgpu.split.help_rule import HelpPolicy, default_share
from strata_mgpu.split.rate_model import ComputeRates, best_share
from strata_mgpu.tools import share_sweep as sw
from tests.test_rate_model import H200_LOADS, H200_SECONDS, measured


def policy(environ: dict[str, str], flag: bool | None = None, frac: str | None = None) -> HelpPolicy:
    """The helper's policy as `strata serve` builds it: the environment, the flags winning."""
    placement = Placement.from_env(env.read(environ), prefill_help=flag, prefill_help_frac=frac)
    return HelpPolicy.of(placement.prefill_help, placement.prefill_help_frac)


def test_modes():
    load = H200_LOADS[0]
    auto = policy({})
    assert auto.mode == "auto" and auto.fixed_share is None
    assert auto.share(2048, load=load) == best_share(load, ComputeRates(), 2048) > 0.45
    assert auto.share(2048, across_cards=False, load=load) == 0.0  # one card: one link
    with pytest.raises(ValueError, match="needs the busy stage's load"):
        auto.share(2048)
    assert policy({}, frac="rule").share(2048) == default_share(2048)
    assert policy({}, frac="0.3").share(2048, across_cards=False) == 0.3
    assert policy({"STRATA_PREFILL_HELP_FRAC": " Rule "}).mode == "rule"
    assert policy({"STRATA_PREFILL_HELP_FRAC": " Rule "}, frac="auto").mode == "auto"  # the flag wins
    assert policy({"STRATA_PREFILL_HELP_FRAC": "0.35"}).fixed_share == 0.35
    for bad, why in (("fast", "expected auto, rule or a number"), ("1", "the share must lie strictly between 0 and 1")):
        with pytest.raises(EnvError, match=f"STRATA_PREFILL_HELP_FRAC='{bad}': {why}"):
            env.read({"STRATA_PREFILL_HELP_FRAC": bad})
    with pytest.raises(EnvError, match="--prefill-help-frac='sometimes'"):
        parse_help_frac("sometimes", "--prefill-help-frac")
    assert Placement(prefill_help_frac="auto").prefill_help_frac == "auto"
    with pytest.raises(ValueError, match="expected auto, rule"):
        Placement(prefill_help_frac="never")
    with pytest.raises(ValueError, match="auto or rule"):
        HelpPolicy(mode="sometimes")


def test_observe_only_in_auto():
    rule = HelpPolicy(mode="rule")
    rule.estimate.share(H200_LOADS[0], 1024)
    rule.observe(1024, 0.45, 0.3)
    assert rule.estimate.observed == 0
    auto = HelpPolicy()
    auto.share(1024, load=H200_LOADS[0])
    auto.observe(1024, None, 0.3)
    assert auto.estimate.observed == 1


def table_clock(tokens: int, policy: HelpPolicy) -> float:
    """One prompt on the H200 pair, from the table (each stage half of it at its own share)."""
    return sum(measured(tokens, policy.share(tokens, load=x)) / 2 for x in H200_LOADS)


def test_sweep_auto_column_and_bounds(tmp_path):
    lengths, shares = [1024, 4096, 8192], [0.0, 0.3, 0.45]
    seen = []
    result = sw.sweep(table_clock, lengths, shares, 2, H200_LOADS, [True, True], "cuda:0,cuda:1", "30b-a3b",
                      on_cell=lambda c: seen.append(sw.describe(c)))
    assert len(seen) == len(lengths) * (len(shares) + 1) and "auto (share 0.492)" in seen[3]
    for n in lengths:
        a = result.auto_cell(n)
        assert a is not None and a.shares == [best_share(x, ComputeRates(), n) for x in H200_LOADS]
        assert a.tok_per_s == pytest.approx(n / measured(n, a.shares[0]))
        assert result.cell(n, 0.3).tok_per_s == pytest.approx(n / H200_SECONDS[n][2])
        off, helped = result.bounds(n)
        assert off == pytest.approx(48 * 391.6e6 / 55.35e9, rel=1e-3) and helped < min(H200_SECONDS[n])
    assert result.auto_cell(8192).shares == [0.0, 0.0] and result.auto_gain(8192) == 0.0
    files = {k: tmp_path / f"sweep.{k}" for k in ("csv", "json", "png")}
    sw.write_csv(result, files["csv"])
    rows = list(csv.DictReader(files["csv"].open()))
    assert len(rows) == 9 and rows[0]["auto_share"] == "0.492" and float(rows[0]["bound_off_s"]) > 0.33
    sw.write_json(result, files["json"])
    data = json.loads(files["json"].read_text())
    assert data["loads"][0]["link_busy"] == 55.4e9 and data["rates"]["mapped_bytes_per_s"] == 23e9
    assert data["auto"][0]["shares"] == [0.4921875, 0.4921875] and len(data["bounds_s"]["1024"]) == 2
    if sw.write_png(result, files["png"]):
        assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    console = Console(file=io.StringIO(), width=250)
    console.print(report.sweep_table(result))
    text = console.file.getvalue()
    assert "0.49: 4,899 (+59%)" in text and "0.340 / 0.173" in text


def test_sweep_on_one_card_has_no_helped_bound_and_no_auto_help():
    result = sw.sweep(table_clock, [1024], [0.0, 0.45], 1, H200_LOADS, [False, False], "cuda:0,cuda:0", "30b-a3b")
    off, helped = result.bounds(1024)
    assert off == helped and result.auto_cell(1024).shares == [0.0, 0.0]
