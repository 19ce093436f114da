"""Every kernel source compiles with nvcc for the consumer (sm_86) and Hopper (sm_90) targets.
Needs nvcc only (CI has it), no GPU."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from strata_mgpu.runtime.cuda_kernels import CUDA_SRC

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


def _plain_kernels() -> dict[str, tuple[str, ...]]:
    """Kernels Python looks up by their plain name (not through a template name expression)."""
    from strata_mgpu.runtime.decode_ops import KERNEL_NAMES, OPS_FILE
    from strata_mgpu.runtime.kernels import COPY_FILE

    return {COPY_FILE: ("copy_f32_wide",), OPS_FILE: KERNEL_NAMES}


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("readelf") is None, reason="nvcc/readelf not found")
@pytest.mark.parametrize("file,names", sorted(_plain_kernels().items()))
def test_plain_kernels_keep_their_names(file, names, tmp_path):
    """A kernel found by plain name must be extern "C": a C++-mangled symbol is 'not found' at launch."""
    cubin = tmp_path / "k.cubin"
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", str(CUDA_SRC / file), "-o", str(cubin)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    symbols = subprocess.run(["readelf", "-Ws", str(cubin)], capture_output=True, text=True).stdout.split()
    assert set(names) <= set(symbols), f"{file}: missing {set(names) - set(symbols)}"
