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


# `nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` on a machine with three cards
SMI_BUS_IDS = "0, 00000000:17:00.0\n1, 00000000:65:00.0\n2, 00000000:CA:00.0\n"
ADDRESS = {0: (0, 0x17, 0), 1: (0, 0x65, 0), 2: (0, 0xCA, 0)}  # nvidia-smi index -> (domain, bus, device)
# GPU0 and GPU1 share a switch; GPU2 hangs off the other socket
THREE = matrix([["X", "OK", "CNS"], ["OK", "X", "CNS"], ["CNS", "CNS", "X"]])


def recorded(monkeypatch, p2p: str, cuda_order: list[int], peers_by_smi_index: dict[tuple[int, int], bool]):
    """nvidia-smi's outputs, and CUDA's devices: ordinal k is nvidia-smi's GPU cuda_order[k]."""
    monkeypatch.setattr(topo, "nvidia_smi_p2p", lambda: p2p)
    monkeypatch.setattr(topo, "nvidia_smi_bus_ids", lambda: SMI_BUS_IDS)
    monkeypatch.setattr(topo, "cuda_bus_ids", lambda: {k: ADDRESS[i] for k, i in enumerate(cuda_order)})
    monkeypatch.setattr(topo, "cuda_peer_access", lambda: {
        (a, b): peers_by_smi_index[i, j] for a, i in enumerate(cuda_order) for b, j in enumerate(cuda_order) if a != b})


def topo_output() -> str:
    r = CliRunner().invoke(main, ["topo"])
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def test_cli_with_recorded_cns_pair(monkeypatch):
    recorded(monkeypatch, matrix([["X", "CNS"], ["CNS", "X"]], ansi=True), [0, 1],
             {(0, 1): False, (1, 0): False})
    assert "GPU0 -> GPU1: CNS (chipset not supported); CUDA peer access no: no P2P" in topo_output()


PEERS = {(i, j): {i, j} == {0, 1} for i in range(3) for j in range(3) if i != j}  # what the cards can do


def test_cuda_ordinals_in_another_order_are_matched_by_pci_address(monkeypatch):
    """CUDA_DEVICE_ORDER=FASTEST_FIRST (the default) can number the cards unlike nvidia-smi."""
    recorded(monkeypatch, THREE, [2, 0, 1], PEERS)
    text = topo_output()
    assert "GPU0 is cuda:1 GPU1 is cuda:2 GPU2 is cuda:0" in text
    assert "GPU0 -> GPU1: OK (status OK); CUDA peer access yes" in text
    assert "GPU1 -> GPU2: CNS (chipset not supported); CUDA peer access no" in text
    assert "disagrees" not in text


def test_a_gpu_hidden_by_cuda_visible_devices_gets_no_cuda_answer(monkeypatch):
    """CUDA_VISIBLE_DEVICES=1,2: CUDA's 0 and 1 are nvidia-smi's GPU1 and GPU2."""
    recorded(monkeypatch, THREE, [1, 2], PEERS)
    text = topo_output()
    assert "GPU0 is hidden from CUDA (CUDA_VISIBLE_DEVICES) GPU1 is cuda:0 GPU2 is cuda:1" in text
    assert "GPU0 -> GPU1: OK (status OK): peer reads possible" in text  # no CUDA answer for GPU0
    assert "GPU1 -> GPU2: CNS (chipset not supported); CUDA peer access no" in text
    assert "disagrees" not in text


@pytest.mark.parametrize("text", ["00000000:65:00.0", "0000:65:00.0", "65:00.0", " 00000000:65:00.0 "])
def test_bus_id_forms(text):
    assert topo.parse_bus_id(text) == (0, 0x65, 0)


def test_bad_bus_ids_are_a_clear_error():
    with pytest.raises(topo.TopoParseError, match="not 'index, pci.bus_id'"):
        topo.parse_smi_bus_ids("No devices were found")
    with pytest.raises(topo.TopoParseError, match="not a PCI bus id"):
        topo.parse_smi_bus_ids("0, [N/A]")
