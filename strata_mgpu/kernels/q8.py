"""Activations as 8-bit integers for the integer dots (`cuda_src/q8_dot.cuh`): which weight types
dot against them, their layout, and `quantize_q8`, the kernel that writes them. The fused,
grouped and dense kernels all read this one layout.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.kernels import nvrtc
from strata_mgpu.quant.formats import FUSED_DECODE_TYPES

Q = GGMLQuantizationType
# Types whose fused kernels dot integers against 8-bit activations (cuda_src/q8_dot.cuh's
# Q8_DOT_TYPES): their input is quantized first, and the twin quantizes it the same way.
Q8_DOT_TYPES = frozenset({Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4})
Q8_WORDS = 12  # words (int32) of one quantized 32-value sub-block: 32 int8, the scale, two half sums, a pad
Q8_THREADS = 256  # quantize_q8: a warp a sub-block
MOE_FILE = "moe_decode.cu"
MOE_NAMES = ("quantize_q8",)  # moe_decode.cu's plain (extern "C") kernels
MOE_EXPRS = tuple(f"{k}<{int(t)}>" for t in FUSED_DECODE_TYPES for k in ("moe_gate_up", "moe_down"))


def quantize_q8(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x [R, n] bf16 -> [R, n / 32 * Q8_WORDS] int32: 8-bit values and a scale a 32-value sub-block."""
    n_sub = x.numel() // 32
    out = torch.empty(x.shape[0], x.shape[1] // 32 * Q8_WORDS, dtype=torch.int32, device=x.device)
    fn = nvrtc.kernel(MOE_FILE, MOE_NAMES[0], MOE_EXPRS, device)
    warps = Q8_THREADS // 32
    nvrtc.launch(fn, -(-n_sub // warps), Q8_THREADS, (x.data_ptr(), np.int64(n_sub), out.data_ptr()), device)
    return out
