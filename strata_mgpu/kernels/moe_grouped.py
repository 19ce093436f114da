"""A gathered pass's routed experts expert by expert (`cuda_src/moe_grouped.cu`): what
`CudaKernels.moe_gathered` runs instead of decode's pick-by-pick kernels once a pass has enough
picks that most experts are picked several times (a short prompt, a wide decode batch).

Decode's kernels read an expert's rows once for every pick of it; here each expert's rows are
read and unpacked once a batch of up to GROUP_VECTORS of its picks. Same integer dots, order and
rounding as decode's kernels, so the output is theirs bit for bit (the twin is the same). Only
where every expert is resident: the rows are read with narrow loads, unsuited to mapped host memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.q8 import Q8_DOT_TYPES, Q8_WORDS, quantize_q8

if TYPE_CHECKING:
    from strata_mgpu.model.expert_layout import ExpertLayout

GROUPED_FILE = "moe_grouped.cu"
GROUPED_NAMES = ("moe_group_combine",)  # its plain (extern "C") kernels
GROUP_VECTORS = 8  # moe_grouped.cu's GROUP_VECTORS (GROUPED_DEFINES): picks' vectors a block holds at once, at most
GROUP_THREADS = 256  # 8 warps, a warp a weight row
GROUP_SHARED_BYTES = 46 * 1024  # the staged vectors, under what every card gives a block
COMBINE_THREADS = 256
# Picks from which a gathered pass goes expert by expert (below it, decode's pick-by-pick kernels:
# fewer launches, and few experts are picked twice): from 32 rows of 30B-A3B (A = 8) up, expert by
# expert is the faster of the two (`tools.bench_kernels`; docs/BENCHMARKS.md).
GROUPED_MIN_PICKS = 256


GROUPED_DEFINES = (("GROUP_VECTORS", GROUP_VECTORS),)  # what moe_grouped.cu is compiled with


def grouped_exprs(types: frozenset) -> tuple[str, ...]:
    return tuple(f"{k}<{int(t)}>" for t in sorted(types) for k in ("moe_group_gate_up", "moe_group_down"))


def grouped_kernel(expression: str, device: torch.device):
    return nvrtc.kernel(GROUPED_FILE, expression, grouped_exprs(Q8_DOT_TYPES), device, GROUPED_DEFINES)


def vectors_a_batch(width: int, q8_words: int) -> int:
    """Picks' quantized vectors of `width` values a block stages at once (0: not one fits)."""
    return min(GROUP_VECTORS, GROUP_SHARED_BYTES // (width // 32 * q8_words * 4))


def picks_by_expert(picks: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """picks [P] expert ids -> (order [P]: pick ids sorted by expert, stable; starts [E + 1]: expert
    e's picks are order[starts[e]:starts[e + 1]]), no host sync. expert_ids: arange(E + 1)."""
    ranked, order = torch.sort(picks, stable=True)
    return order, torch.searchsorted(ranked, expert_ids)


def moe_grouped(device: torch.device, expert_ids: torch.Tensor, table: tuple, lay: ExpertLayout, hq: torch.Tensor,
                weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """A layer's routed experts for hq (h [T, D] quantized), weights [T, A] fp32, experts [T, A] ->
    [T, D] bf16. table: the layer's expert table as moe_decode.cu's kernels take it; expert_ids:
    0..E on the device. Both of the layout's types must be integer ones (Q8_DOT_TYPES)."""
    n_experts = expert_ids.numel() - 1

    t, a = experts.shape
    d = hq.shape[1] // Q8_WORDS * 32
    f = lay.gate_weights // d
    nv_gu, nv_down = vectors_a_batch(d, Q8_WORDS), vectors_a_batch(f, Q8_WORDS)
    assert lay.gate_type in Q8_DOT_TYPES and lay.down_type in Q8_DOT_TYPES and nv_gu > 0 and nv_down > 0
    order, starts = picks_by_expert(experts.reshape(-1), expert_ids)
    warps = GROUP_THREADS // 32
    act = torch.empty(t * a, f, dtype=torch.bfloat16, device=hq.device)
    fn = grouped_kernel(f"moe_group_gate_up<{int(lay.gate_type)}>", device)
    nvrtc.launch(fn, (-(-f // warps), n_experts), GROUP_THREADS,
                 (hq.data_ptr(), order.data_ptr(), starts.data_ptr(), np.int32(a), np.int32(nv_gu), *table,
                  np.int32(d), np.int32(f), np.int64(lay.gate_bytes // f), act.data_ptr()), device,
                 shared_mem=nv_gu * (d // 32) * Q8_WORDS * 4)
    aq = quantize_q8(act, device)
    y = torch.empty(t * a, d, dtype=torch.float32, device=hq.device)
    fn = grouped_kernel(f"moe_group_down<{int(lay.down_type)}>", device)
    nvrtc.launch(fn, (-(-d // warps), n_experts), GROUP_THREADS,
                 (aq.data_ptr(), order.data_ptr(), starts.data_ptr(), np.int32(nv_down), *table, np.int32(d),
                  np.int32(f), np.int64(lay.down_bytes // d), np.int64(lay.down_offset), y.data_ptr()),
                 device, shared_mem=nv_down * (f // 32) * Q8_WORDS * 4)
    out = torch.empty(t, d, dtype=torch.bfloat16, device=hq.device)
    fn = grouped_kernel(GROUPED_NAMES[0], device)
    nvrtc.launch(fn, -(-t * d // COMBINE_THREADS), COMBINE_THREADS,
                 (y.data_ptr(), weights.data_ptr(), np.int32(a), np.int64(t * d), np.int32(d), out.data_ptr()),
                 device)
    return out
