"""`strata topo`: can the cards read each other's memory? `nvidia-smi topo -p2p r`, parsed,
cross-checked with CUDA's own peer-access query, and what the runtime does for each pair.

nvidia-smi numbers the GPUs by PCI bus; CUDA numbers the ones it sees in its own order after
CUDA_VISIBLE_DEVICES has hidden some. The two are matched by PCI address, never by position.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

# nvidia-smi's legend for the P2P matrix.
LEGEND = {
    "X": "self",
    "OK": "status OK",
    "CNS": "chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "topology not supported",
    "NS": "not supported",
    "U": "unknown",
}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_GPU = re.compile(r"^GPU\d+$")
# domain:bus:device.function in hex; nvidia-smi writes an 8-digit domain, lspci and CUDA 4 digits
_BUS_ID = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})(?:\.[0-7])?$", re.IGNORECASE)
PciAddress = tuple[int, int, int]  # (domain, bus, device): the function is left out, CUDA does not give it


class TopoParseError(ValueError):
    """The text is not an `nvidia-smi topo -p2p` matrix."""


@dataclass(frozen=True)
class P2PMatrix:
    gpus: tuple[str, ...]  # 'GPU0', 'GPU1', ...
    status: dict[tuple[int, int], str]  # (reader, owner) -> legend code

    def pairs(self) -> list[tuple[int, int, str]]:
        n = len(self.gpus)
        return [(i, j, self.status[i, j]) for i in range(n) for j in range(n) if i != j]


def parse_p2p(text: str) -> P2PMatrix:
    """Parse the matrix printed by `nvidia-smi topo -p2p r` (ANSI colour codes allowed)."""
    lines = [_ANSI.sub("", line).strip() for line in text.splitlines()]
    header_at = next((k for k, line in enumerate(lines) if line.split() and all(_GPU.match(t) for t in line.split())),
                     None)
    if header_at is None:
        raise TopoParseError("no 'GPU0 GPU1 ...' header line")
    gpus = tuple(lines[header_at].split())
    status: dict[tuple[int, int], str] = {}
    for i, name in enumerate(gpus):
        row_line = lines[header_at + 1 + i] if header_at + 1 + i < len(lines) else ""
        cells = row_line.split()
        if not cells or cells[0] != name or len(cells) < len(gpus) + 1:
            raise TopoParseError(f"row for {name} missing or short: {row_line!r}")
        for j, code in enumerate(cells[1:len(gpus) + 1]):
            if code not in LEGEND:
                raise TopoParseError(f"unknown status {code!r} for {name} -> {gpus[j]}")
            status[i, j] = code
    return P2PMatrix(gpus, status)


def parse_bus_id(text: str) -> PciAddress:
    """'00000000:65:00.0' (nvidia-smi) or '0000:65:00.0' (lspci) -> (0, 0x65, 0)."""
    m = _BUS_ID.match(text.strip())
    if m is None:
        raise TopoParseError(f"not a PCI bus id: {text!r}")
    return int(m[1] or "0", 16), int(m[2], 16), int(m[3], 16)


def parse_smi_bus_ids(text: str) -> dict[int, PciAddress]:
    """`nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` -> {nvidia-smi index: address}."""
    addresses = {}
    for line in filter(str.strip, text.splitlines()):
        index, sep, bus_id = line.partition(",")
        if not sep or not index.strip().isdigit():
            raise TopoParseError(f"not 'index, pci.bus_id': {line!r}")
        addresses[int(index)] = parse_bus_id(bus_id)
    return addresses


@dataclass(frozen=True)
class CudaView:
    """CUDA's answers keyed by nvidia-smi's GPU index (the matrix's GPUn)."""

    ordinals: dict[int, int]  # nvidia-smi index -> CUDA ordinal; a GPU hidden from CUDA is absent
    peers: dict[tuple[int, int], bool]  # (reader, owner), nvidia-smi indexes -> CUDA peer access


def cuda_view(smi_addresses: dict[int, PciAddress], cuda_addresses: dict[int, PciAddress],
              cuda_peers: dict[tuple[int, int], bool]) -> CudaView:
    """Match nvidia-smi's GPUs to CUDA's ordinals by PCI address, and re-key CUDA's peer answers."""
    ordinal_at = {address: ordinal for ordinal, address in cuda_addresses.items()}
    ordinals = {i: ordinal_at[a] for i, a in smi_addresses.items() if a in ordinal_at}
    peers = {(i, j): cuda_peers[oi, oj] for i, oi in ordinals.items() for j, oj in ordinals.items()
             if i != j and (oi, oj) in cuda_peers}
    return CudaView(ordinals, peers)


def runtime_plan(code: str) -> str:
    if code == "X":
        return "-"
    if code == "OK":
        return "peer reads possible; strata still hands over through mapped host memory"
    return "no P2P: hand-over through mapped pinned host memory (copy_f32_wide)"


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def nvidia_smi_p2p() -> str | None:
    """None where nvidia-smi is missing or fails."""
    return _nvidia_smi("topo", "-p2p", "r")


def nvidia_smi_bus_ids() -> str | None:
    """None where nvidia-smi is missing or fails."""
    return _nvidia_smi("--query-gpu=index,pci.bus_id", "--format=csv,noheader")


def cuda_bus_ids() -> dict[int, PciAddress] | None:
    """Each visible CUDA device's PCI address by ordinal, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    # torch's device properties carry the PCI address; its type stubs do not declare it
    return {i: (p.pci_domain_id, p.pci_bus_id, p.pci_device_id) for i, p in enumerate(props)}  # type: ignore[attr-defined]


def cuda_peer_access() -> dict[tuple[int, int], bool] | None:
    """CUDA's answer for every ordered pair of visible devices, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    return {(i, j): torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j}
