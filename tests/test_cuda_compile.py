"""Every kernel source compiles with nvcc for the consumer (sm_86) and Hopper (sm_90) targets.
Needs nvcc only (CI has it), no GPU."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from strata_mgpu.kernels.nvrtc import CUDA_SRC

SOURCES = sorted(CUDA_SRC.glob("*.cu"))


def test_there_are_kernel_sources():
    assert SOURCES


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles(source, arch, tmp_path):
    r = subprocess.run(["nvcc", "-std=c++17", f"-arch={arch}", "-c", str(source), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr

