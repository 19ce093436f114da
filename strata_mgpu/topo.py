"""`strata topo`: can the cards read each other's memory? `nvidia-smi topo -p2p r`, parsed,
cross-checked with CUDA's own peer-access query, and what the runtime does for each pair."""

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


def runtime_plan(code: str) -> str:
    """What strata does for a pair with this status."""
    if code == "X":
        return "-"
    if code == "OK":
        return "peer reads possible; strata still hands over through mapped host memory"
    return "no P2P: hand-over through mapped pinned host memory (copy_f32_wide)"


def nvidia_smi_p2p() -> str | None:
    """The raw `nvidia-smi topo -p2p r` output, or None where nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "topo", "-p2p", "r"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def cuda_peer_access() -> dict[tuple[int, int], bool] | None:
    """CUDA's answer for every ordered pair of visible devices, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    return {(i, j): torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j}
