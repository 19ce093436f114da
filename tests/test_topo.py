"""The P2P matrix parser on outputs in nvidia-smi's layout: OK, CNS, NS, TNS, ANSI codes, 1/2/4 GPUs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from strata_mgpu import topo
from strata_mgpu.cli import main

LEGEND = """
Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
  GNS  = GPU not supported
  TNS  = Topology not supported
  NS   = Not supported
  U    = Unknown
"""


def matrix(rows: list[list[str]], ansi: bool = False) -> str:
    n = len(rows)
    head = " \t" + "\t".join(f"GPU{i}" for i in range(n)) + "\t\n"
    body = ""
    for i, row in enumerate(rows):
        cells = [f"\x1b[1;32m{c}\x1b[0m" if ansi and c != "X" else c for c in row]
        body += f" GPU{i}\t" + "\t".join(cells) + "\t\n"
    return head + body + LEGEND


@pytest.mark.parametrize("code", ["OK", "CNS", "NS", "TNS", "GNS", "U"])
def test_two_gpus(code):
    m = topo.parse_p2p(matrix([["X", code], [code, "X"]]))
    assert m.gpus == ("GPU0", "GPU1")
    assert m.pairs() == [(0, 1, code), (1, 0, code)]


def test_one_and_four_gpus_and_ansi():
    assert topo.parse_p2p(matrix([["X"]])).pairs() == []
    rows = [["X", "OK", "CNS", "CNS"], ["OK", "X", "CNS", "CNS"], ["CNS", "CNS", "X", "OK"], ["CNS", "CNS", "OK", "X"]]
    m = topo.parse_p2p(matrix(rows, ansi=True))
    assert len(m.gpus) == 4 and m.status[0, 1] == "OK" and m.status[1, 2] == "CNS" and m.status[3, 2] == "OK"


@pytest.mark.parametrize("text, message", [
    ("No devices were found", "header"),
    (" \tGPU0\tGPU1\n GPU0\tX\tOK\n", "row for GPU1"),
    (" \tGPU0\tGPU1\n GPU0\tX\tYES\n GPU1\tYES\tX\n", "unknown status 'YES'"),
])
def test_bad_output_is_a_clear_error(text, message):
    with pytest.raises(topo.TopoParseError, match=message):
        topo.parse_p2p(text)


def test_runtime_plan_for_no_p2p():
    assert "mapped pinned host memory" in topo.runtime_plan("CNS")
    assert topo.runtime_plan("X") == "-"


def test_cli_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(topo, "nvidia_smi_p2p", lambda: None)
    r = CliRunner().invoke(main, ["topo"])
    assert r.exit_code == 0 and "nvidia-smi not found" in r.output


def test_cli_with_recorded_cns_pair(monkeypatch):
    monkeypatch.setattr(topo, "nvidia_smi_p2p", lambda: matrix([["X", "CNS"], ["CNS", "X"]], ansi=True))
    monkeypatch.setattr(topo, "cuda_peer_access", lambda: {(0, 1): False, (1, 0): False})
    r = CliRunner().invoke(main, ["topo"])
    assert r.exit_code == 0, r.output
    assert "GPU0 -> GPU1: CNS (chipset not supported); CUDA peer access no: no P2P" in r.output.replace("\n", " ")
