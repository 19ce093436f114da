"""Every kernel source compiles with nvcc for the consumer (sm_86) and Hopper (sm_90) targets,
and what nvcc compiles of it holds every kernel the runtime launches from it. Needs nvcc only
(CI has it), no GPU."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from strata_mgpu.kernels.nvrtc import CUDA_SRC
from tests.test_nvrtc_compile import DEFINES, KERNELS

SOURCES = sorted(CUDA_SRC.glob("*.cu"))


def defines(file: str) -> list[str]:
    """The -D options the runtime compiles `file` with (nvrtc.kernel's defines)."""
    return [f"-D{name}={value}" for name, value in DEFINES.get(file, ())]


def test_the_sources_are_the_files_the_runtime_compiles():
    """test_compiles compiles each file the kernel modules load (KERNELS: each one's plain names
    and template name expressions, from the modules' own tables), and no other."""
    assert [p.name for p in SOURCES] == sorted(KERNELS)
    assert all(names or expressions for names, expressions in KERNELS.values())


def kernel_name(entry: str) -> str:
    """A PTX entry as the runtime names the kernel: an instantiation of a `template <int N>`
    kernel from its mangled name, e.g. _Z12dequant_bf16ILi12EEvPKh... -> dequant_bf16<12>
    (length-prefixed name, then I L i N E E), int and bool arguments after it too (L i N E, e.g.
    dense_q8<8, 4>; L b 0/1 E, e.g. attn_split<128, true, false>); any other entry as it is, so a
    plain name matches only an unmangled (extern "C") kernel."""
    m = re.match(r"_Z(\d+)", entry)
    if m is None:
        return entry
    name = entry[m.end():m.end() + int(m.group(1))]
    arg = re.match(r"ILi(\d+)E((?:L[ib]\d+E)*)E", entry[m.end() + len(name):])
    if arg is None:
        return entry
    more = [f", {v}" if kind == "i" else ", true" if v == "1" else ", false"
            for kind, v in re.findall(r"L([ib])(\d+)E", arg.group(2))]
    return f"{name}<{arg.group(1)}{''.join(more)}>"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("file", sorted(KERNELS))
def test_nvcc_compiles_every_kernel_the_runtime_launches(file, tmp_path):
    """The PTX nvcc makes of a file has an entry for each kernel the runtime looks up there: a
    plain name unmangled, each template expression `name<N>` through the file's explicit
    instantiations. NVRTC instantiates a template from its name expression alone, so a missing
    instantiation still runs (tests/test_nvrtc_compile.py passes) but leaves test_compiles
    compiling none of that kernel's body for that N."""
    names, expressions = KERNELS[file]
    ptx = tmp_path / "k.ptx"
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", *defines(file), "-ptx", str(CUDA_SRC / file), "-o",
                        str(ptx)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    entries = {kernel_name(e) for e in re.findall(r"\.entry\s+([\w$]+)\s*\(", ptx.read_text())}
    missing = (set(names) | set(expressions)) - entries
    assert not missing, f"{file}: no kernel compiled for {sorted(missing)} (compiled: {sorted(entries)})"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles(source, arch, tmp_path):
    r = subprocess.run(["nvcc", "-std=c++17", f"-arch={arch}", *defines(source.name), "-c", str(source), "-o",
                        str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr

