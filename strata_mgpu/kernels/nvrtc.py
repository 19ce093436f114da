"""Loader for our CUDA kernels: `cuda_src/*.cu` compiled by NVRTC through CuPy, once per (file,
template instantiation, device), and launched on torch's current stream. CuPy is imported only
here and only when a CUDA stage is built.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

CUDA_SRC = Path(__file__).resolve().parents[1] / "cuda_src"


INSTALL_HINT = ("pip install 'strata-mgpu[cuda12]' or 'strata-mgpu[cuda13]' (cupy-cuda12x or cupy-cuda13x, "
                "matching torch.version.cuda)")


class KernelUnavailable(RuntimeError):
    """CuPy or the kernel source is missing: the stage falls back to the torch twins."""


def require_cupy():
    """The `cupy` module, or KernelUnavailable saying how to install it."""
    try:
        import cupy
    except ImportError as e:  # also where sys.modules["cupy"] is None
        raise KernelUnavailable(f"CuPy is not installed ({INSTALL_HINT})") from e
    return cupy


def cuda_source(name: str) -> str:
    path = CUDA_SRC / name
    if not path.exists():
        raise KernelUnavailable(f"kernel source {path} is missing")
    return path.read_text()


Defines = tuple[tuple[str, int], ...]  # (NAME, value): constants a kernel file takes from its launcher


def compile_options(defines: Defines = ()) -> tuple[str, ...]:
    """NVRTC's options for a kernel file (tests/test_nvrtc_compile.py compiles with them too)."""
    return ("-std=c++17", f"-I{CUDA_SRC}", *(f"-D{name}={value}" for name, value in defines))


@cache
def _module(file: str, name_expressions: tuple[str, ...], device_index: int, defines: Defines):
    cupy = require_cupy()
    with cupy.cuda.Device(device_index):
        mod = cupy.RawModule(code=cuda_source(file), options=compile_options(defines),
                              name_expressions=name_expressions or None)
        mod.compile()
    return mod


def kernel(file: str, expression: str, all_expressions: tuple[str, ...], device: torch.device,
           defines: Defines = ()):
    """The compiled kernel `expression` (e.g. 'dequant_bf16<12>') from `file` for `device`; `defines`:
    the constants the file takes from its launcher (it stops at `#error` without them)."""
    mod = _module(file, all_expressions, device.index or 0, defines)
    return mod.get_function(expression)


@cache
def _cupy_stream(stream_ptr: int, device_index: int):
    cupy = require_cupy()
    return cupy.cuda.Device(device_index), cupy.cuda.ExternalStream(stream_ptr, device_index)


def launch(fn, grid: int | tuple[int, ...], block: int, args: tuple, device: torch.device,
           shared_mem: int = 0) -> None:
    """Launch on torch's current stream of `device` (so stream order and events are torch's)."""
    dev, stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream, device.index or 0)
    with dev, stream:
        fn(grid if isinstance(grid, tuple) else (grid,), (block,), args, shared_mem=shared_mem)
