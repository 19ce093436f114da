"""The CUDA block decoders (cuda_src/ggml_blocks.cuh) compiled for the host with g++ and checked
bit-exact against the torch twin (quant/dequant.py) on random blocks of every cuda_dequant type.

No GPU needed: the header's device intrinsics are plain IEEE fp32 operations (`__fmul_rn` is a
rounded multiply, ...), so with contraction off (`-ffp-contract=off`: no fused multiply-add) the
host build rounds as the device does. tests/test_gpu_quant.py repeats the comparison on a GPU
through the real kernels; this one catches a wrong bit layout on every CI run.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from strata_mgpu.kernels import nvrtc
from strata_mgpu.quant.dequant import dequantize_rows
from strata_mgpu.quant.formats import CUDA_DEQUANT_TYPES, block_format
from tests.test_quant import assert_same_bits, fresh_seed, raw_blocks

# Just enough of cuda_fp16.h / cuda_bf16.h and the device intrinsics for ggml_blocks.cuh.
SHIM = r"""
#pragma once
#include <cstring>
#include <cstdint>
#define __device__
#define __forceinline__ inline
struct __half { unsigned short x; };
inline __half __ushort_as_half(unsigned short x) { return __half{x}; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __half2float(__half h) {  // exact, subnormals included
    const unsigned s = (h.x >> 15) & 1, e = (h.x >> 10) & 31, m = h.x & 1023;
    unsigned bits;
    if (e == 31) bits = (s << 31) | 0x7F800000u | (m << 13);
    else if (e) bits = (s << 31) | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = s << 31;
    else {
        int k = 0;
        unsigned mm = m;
        while (!(mm & 1024)) { mm <<= 1; ++k; }
        bits = (s << 31) | ((unsigned)(113 - k) << 23) | ((mm & 1023) << 13);
    }
    return __uint_as_float(bits);
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    // CUDA's: result byte k is byte (s >> 4k) & 7 of y:x (the selector's 4th bit is not used)
    const unsigned long long xy = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int k = 0; k < 4; ++k) r |= (unsigned)((xy >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k);
    return r;
}
"""

HARNESS = r"""
#include "ggml_blocks.cuh"
template <int T> static void run(const u8* src, long long n_sub, float* out) {
    const int per = Fmt<T>::QK / 32;
    for (long long i = 0; i < n_sub; ++i) sub_block<T>(src + (i / per) * Fmt<T>::BYTES, (int)(i % per), out + 32 * i);
}
#define CASE(T) case T: run<T>(src, n_sub, out); return 0;
extern "C" int decode(int type, const u8* src, long long n_sub, float* out) {
    switch (type) { GGML_CUDA_TYPES(CASE) }
    return 1;
}
"""


def build_host_lib(d: Path, harness: str, shim: str = SHIM) -> ctypes.CDLL:
    """`harness` (C++ including headers of cuda_src/) built in folder d as a shared library for the
    host, `shim` standing in for the CUDA headers; the test is skipped where g++ is missing."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    (d / "cuda_fp16.h").write_text(shim)
    (d / "cuda_bf16.h").write_text('#pragma once\n#include "cuda_fp16.h"\n')
    (d / "harness.cpp").write_text(harness)
    lib = d / "harness.so"
    r = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                        "-Wno-unknown-pragmas", f"-I{d}", f"-I{nvrtc.CUDA_SRC}", str(d / "harness.cpp"),
                        "-o", str(lib)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def host_decoders(tmp_path_factory):
    so = build_host_lib(tmp_path_factory.mktemp("blocks"), HARNESS)
    so.decode.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
    return so


@pytest.mark.parametrize("offset", [0, 1, 2, 3])  # the runs read as aligned words: every misalignment
@pytest.mark.parametrize("ggml_type", CUDA_DEQUANT_TYPES, ids=lambda t: t.name)
def test_cuda_block_decoders_on_the_host_equal_the_twin(host_decoders, ggml_type, offset):
    fmt = block_format(ggml_type)
    seed = fresh_seed()
    n_weights = 256 * 24
    blocks = raw_blocks(ggml_type, n_weights // fmt.block_size, np.random.default_rng(seed))
    out = np.full(n_weights, np.nan, dtype=np.float32)
    # at `offset` past an aligned address, with room after: runs are read as aligned words, up to 3
    # bytes around them
    room = np.zeros(blocks.nbytes + 8, dtype=np.uint8)
    room[offset:offset + blocks.nbytes] = blocks.view(np.uint8).reshape(-1)
    assert host_decoders.decode(int(ggml_type), room.ctypes.data + offset, n_weights // 32, out.ctypes.data) == 0
    want = dequantize_rows(torch.from_numpy(blocks.reshape(1, -1)), ggml_type, n_weights).numpy()
    assert_same_bits(out.reshape(-1, 256), want.reshape(-1, 256), f"{ggml_type.name}, seed {seed}")
