"""Every kernel compiles with NVRTC, the compiler the runtime uses (through CuPy), with the options
it passes, and every kernel the runtime looks up is found by that name: a plain name must stay
unmangled (extern "C"), a template must resolve through its name expression. NVRTC differs from
nvcc (no implicit host headers: `INFINITY` is undefined there), so the nvcc check alone let both
kinds of mistake through to the GPU. Needs the `nvidia-cuda-nvrtc` wheel (the `nvrtc` extra) and the CUDA
headers, no GPU; skips without them.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from pathlib import Path

import pytest

from strata_mgpu.kernels import decode_ops, dense, moe_grouped, nvrtc, q8
from strata_mgpu.kernels import experts as kernels
from strata_mgpu.quant import formats
from strata_mgpu.stage.experts import cpu_handover


def _libnvrtc() -> ctypes.CDLL | None:
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for lib in sorted(Path(root).glob("*/lib/libnvrtc.so*")):
            if "builtins" not in lib.name:
                return ctypes.CDLL(str(lib))
    return None


def _cuda_include() -> Path | None:
    """The toolkit's headers (cuda_bf16.h, ...), which CuPy puts on NVRTC's include path too."""
    candidates = [Path(p) / "include" for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if p]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parents[1] / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda_bf16.h").exists()), None)


NVRTC = _libnvrtc()
CUDA_INCLUDE = _cuda_include()
# file -> (names looked up as they are, template name expressions)
# the constants a file takes from its launcher (`nvrtc.kernel`'s defines); () for the rest
DEFINES = {moe_grouped.GROUPED_FILE: moe_grouped.GROUPED_DEFINES, decode_ops.ATTN_FILE: decode_ops.ATTN_DEFINES}
KERNELS = {
    kernels.DEQUANT_FILE: ((), kernels._DEQUANT_EXPRS),
    q8.MOE_FILE: (q8.MOE_NAMES, q8.MOE_EXPRS),
    kernels.COPY_FILE: (("copy_f32_wide",), ()),
    dense.DENSE_FILE: ((), dense.DENSE_EXPRS),
    moe_grouped.GROUPED_FILE: (moe_grouped.GROUPED_NAMES, moe_grouped.grouped_exprs(q8.Q8_DOT_TYPES)),
    decode_ops.OPS_FILE: (decode_ops.KERNEL_NAMES, ()),
    decode_ops.ATTN_FILE: ((), decode_ops.ATTN_ALL_EXPRS),  # every pair of cache types
    cpu_handover.HANDOVER_FILE: (cpu_handover.KERNELS, ()),
}


def _check(rc: int, what: str, log: str = "") -> None:
    assert rc == 0, f"{what}: nvrtc error {rc}\n{log}"


def compile_ptx(source: str, expressions: tuple[str, ...], arch: str, defines: nvrtc.Defines = ()
                ) -> tuple[str, dict[str, str]]:
    """PTX of `source` and the lowered (mangled) name of each expression."""
    prog = ctypes.c_void_p()
    _check(NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), "create")
    try:
        for e in expressions:
            _check(NVRTC.nvrtcAddNameExpression(prog, e.encode()), f"name expression {e}")
        options = [o.encode() for o in (*nvrtc.compile_options(defines), f"-I{CUDA_INCLUDE}",
                                         f"--gpu-architecture={arch}")]
        rc = NVRTC.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(prog, log)
        _check(rc, "compile", log.value.decode(errors="replace"))
        lowered = {}
        for e in expressions:
            name = ctypes.c_char_p()
            _check(NVRTC.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(name)), f"lowered name of {e}")
            lowered[e] = name.value.decode()
        NVRTC.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        _check(NVRTC.nvrtcGetPTX(prog, ptx), "ptx")
        return ptx.value.decode(), lowered
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.skipif(NVRTC is None or CUDA_INCLUDE is None,
                    reason="libnvrtc (pip install nvidia-cuda-nvrtc) or the CUDA headers not found")
@pytest.mark.parametrize("arch", ["compute_86", "compute_90"])
@pytest.mark.parametrize("file", sorted(KERNELS))
def test_kernels_compile_with_nvrtc_and_are_found(file, arch):
    plain, expressions = KERNELS[file]
    ptx, lowered = compile_ptx(nvrtc.cuda_source(file), expressions, arch, DEFINES.get(file, ()))
    entries = set(re.findall(r"\.entry\s+([\w$]+)\s*\(", ptx))
    assert set(plain) <= entries, f"{file}: not found by plain name: {set(plain) - entries}"
    assert set(lowered.values()) <= entries, f"{file}: name expressions without a kernel"


@pytest.mark.skipif(NVRTC is None or CUDA_INCLUDE is None,
                    reason="libnvrtc (pip install nvidia-cuda-nvrtc) or the CUDA headers not found")
@pytest.mark.parametrize("file", sorted(DEFINES))
def test_a_file_takes_its_launchers_constants_or_does_not_compile(file):
    """A constant the launcher plans with (decode_ops.ATTN_MIN_KEYS, moe_grouped.GROUP_VECTORS) is
    the kernel's only through the define: without it the file stops at its #error, naming it."""
    expressions = KERNELS[file][1]
    for name, _ in DEFINES[file]:
        rest = tuple(d for d in DEFINES[file] if d[0] != name)
        with pytest.raises(AssertionError, match=name):
            compile_ptx(nvrtc.cuda_source(file), expressions, "compute_90", rest)


def test_every_source_file_is_covered():
    assert {p.name for p in nvrtc.CUDA_SRC.glob("*.cu")} == set(KERNELS)


def test_cuda_type_list_is_the_format_tables():
    """ggml_blocks.cuh's GGML_CUDA_TYPES (the explicit instantiations of dequant.cu and
    moe_decode.cu) lists exactly the table's cuda_dequant types; fused_decode needs cuda_dequant."""
    src = nvrtc.cuda_source("ggml_blocks.cuh")
    listed = re.search(r"#define GGML_CUDA_TYPES\(X\)(.*)", src).group(1)
    assert sorted(int(t) for t in re.findall(r"X\((\d+)\)", listed)) == sorted(formats.CUDA_DEQUANT_TYPES)
    assert set(formats.FUSED_DECODE_TYPES) <= set(formats.CUDA_DEQUANT_TYPES)
    for file in (kernels.DEQUANT_FILE, q8.MOE_FILE):
        assert "GGML_CUDA_TYPES(" in nvrtc.cuda_source(file).split("#define")[-1], file


def test_block_sizes_in_cuda_equal_gguf():
    """Fmt<TYPE>'s QK (weights) and BYTES for each type: the block, or 32 weights of a float type."""
    src = nvrtc.cuda_source("ggml_blocks.cuh")
    sizes = {int(t): (int(qk), int(nbytes)) for t, qk, nbytes in
             re.findall(r"struct Fmt<(\d+)> \{ static const int QK = (\d+), BYTES = (\d+); \}", src)}
    for t in formats.CUDA_DEQUANT_TYPES:
        fmt = formats.block_format(t)
        want = (32, 32 * fmt.type_size) if fmt.is_float else (fmt.block_size, fmt.type_size)
        assert sizes.get(int(t)) == want, t.name


@pytest.mark.skipif(NVRTC is None or CUDA_INCLUDE is None,
                    reason="libnvrtc (pip install nvidia-cuda-nvrtc) or the CUDA headers not found")
def test_handover_send_argument_is_laid_out_as_its_struct():
    """SEND_ARGS (what CuPy copies into handover_send's one argument) against cpu_handover.cu's
    HandoverSend, compiled: every field's offset and the size, as NVRTC lays the struct out. A
    field left out, moved or retyped on either side fails to compile; so does a wrong assertion
    (the last case: the check can fail)."""
    def asserting(offsets: dict[str, int], size: int) -> str:
        checks = "".join(f"static_assert(__builtin_offsetof(HandoverSend, {name}) == {at}, \"{name}\");\n"
                         for name, at in offsets.items())
        return (nvrtc.cuda_source(cpu_handover.HANDOVER_FILE) + checks +
                f"static_assert(sizeof(HandoverSend) == {size}, \"size\");\n")

    offsets, size = cpu_handover.SEND_OFFSETS, cpu_handover.SEND_ARGS.itemsize
    assert set(offsets) >= set(cpu_handover.SEND_LAYER_PTRS) | set(cpu_handover.SEND_SIZES)
    compile_ptx(asserting(offsets, size), (), "compute_90")
    with pytest.raises(AssertionError, match="compile"):
        compile_ptx(asserting({**offsets, "T": offsets["T"] + 4}, size), (), "compute_90")


def test_send_args_fill_writes_every_field():
    """SendArgs' flat views write the named fields: a layer's five addresses and five sizes, the
    hand-over's fixed ones kept."""
    per_layer = cpu_handover.SEND_LAYER_PTRS + cpu_handover.SEND_SIZES
    fixed = {name: 1000 + k for k, name in enumerate(n for n in cpu_handover.SEND_ARGS.names if n not in per_layer)}
    args = cpu_handover.SendArgs(**fixed)
    value = args.fill(2**40 + 1, 2**40 + 2, 2**40 + 3, 2**40 + 4, 2**40 + 5, 3, 8, 2048, 128, 7)
    assert value.shape == (1,) and value.dtype == cpu_handover.SEND_ARGS
    got = {name: int(value[name][0]) for name in cpu_handover.SEND_ARGS.names}
    want = {**fixed, **dict(zip(cpu_handover.SEND_LAYER_PTRS, range(2**40 + 1, 2**40 + 6), strict=True)),
            **dict(zip(cpu_handover.SEND_SIZES, (3, 8, 2048, 128, 7), strict=True))}
    assert got == want
