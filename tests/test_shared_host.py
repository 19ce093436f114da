"""tools/shared_host.py: its option parsing, and a short sweep on the tiny preset that writes
every cell it printed."""

from __future__ import annotations

import json
import os

import pytest

from strata_mgpu.kernels import cpu_experts
from strata_mgpu.tools import shared_host
from strata_mgpu.tools.shared_host import default_busy, default_threads, parse_cores


def test_cores_and_counts_parse_or_say_what_is_wrong():
    assert parse_cores("0-3") == [0, 1, 2, 3] and parse_cores("0,2,4-5") == [0, 2, 4, 5] and parse_cores("1") == [1]
    for bad in ("3-1", "a", "0-", "-1", ""):
        with pytest.raises(ValueError, match="is not a CPU id"):
            parse_cores(bad)
    with pytest.raises(ValueError, match="--busy '1,x'"):
        shared_host.parse_counts("1,x", "--busy", 0)
    with pytest.raises(ValueError, match="each 1 or more"):
        shared_host.parse_counts("0,2", "--threads", 1)
    assert default_busy(4) == [0, 1, 2, 4] and default_busy(2) == [0, 1, 2] and default_busy(1) == [0, 1]
    assert default_threads(4) == [1, 2, 3, 4] and default_threads(16) == [1, 2, 4, 8, 12, 16]


def test_cores_outside_the_process_s_are_refused(capsys):
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit, match=f"--cores {beyond}: this process may only use"):
        shared_host.main(["--cores", str(beyond)])


@pytest.mark.skipif(cpu_experts.ggml_missing() is not None, reason="ggml-python is not installed")
def test_a_short_sweep_prints_and_writes_every_cell(tmp_path, capsys):
    cores = sorted(os.sched_getaffinity(0))[:1]
    out = tmp_path / "shared.json"
    affinity = os.sched_getaffinity(0)
    try:
        assert shared_host.main(["--preset", "tiny", "--cores", str(cores[0]), "--busy", "0,1", "--threads", "1",
                                 "--warmup", "0", "--seconds", "0.2", "--json", str(out)]) == 0
    finally:
        os.sched_setaffinity(0, affinity)
    report = json.loads(out.read_text())
    assert report["cores"] == cores and report["model"] == "the tiny preset"
    assert [(c["busy"], c["threads"]) for c in report["cells"]] == [(0, "1"), (0, "adaptive"), (1, "1"),
                                                                    (1, "adaptive")]
    assert all(c["steps"] >= 2 and c["tok_per_s"] > 0 for c in report["cells"])
    # one core: the adaptive executor has one thread, so nothing to climb back to
    assert all(c["mean_threads"] == 1 for c in report["cells"]) and report["recovery_s"] is not None
    printed = capsys.readouterr().out
    assert printed.count(" busy: ") == 4 and "adaptive: back on every thread" in printed
