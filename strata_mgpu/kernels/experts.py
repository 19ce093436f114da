"""Ops of the streamed-expert path, each with a plain torch twin and a CUDA version.

`TorchKernels` is the twin (any device, the CPU included); `CudaKernels` overrides what it
speeds up (`cuda_src/dequant.cu`, `torch._grouped_mm`, `cuda_src/moe_decode.cu`).

Every op counts the path it ran in the kernel set's `paths` (see `kernels.paths`), and a CUDA op
that falls back to its twin says why, once, in a warning. Replays of a captured decode step run
no Python and add nothing to the counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.moe_grouped import (
    GROUPED_MIN_PICKS,
    grouped_exprs,
    grouped_kernel,
    moe_grouped,
    vectors_a_batch,
)
from strata_mgpu.kernels.paths import PathCounter, warn_once
from strata_mgpu.kernels.q8 import MOE_EXPRS, MOE_FILE, Q8_DOT_TYPES, Q8_WORDS, quantize_q8
from strata_mgpu.kernels.resident import ResidentExperts
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.quant.dequant import dequantize_rows
from strata_mgpu.quant.formats import CUDA_DEQUANT_TYPES, block_format

log = logging.getLogger("strata.kernels")
Q = GGMLQuantizationType
DEQUANT_FILE = "dequant.cu"
COPY_FILE = "copy_f32_wide.cu"
# Which types have which kernel: quant/formats.py's table (CUDA_DEQUANT_TYPES is re-exported here).
_DEQUANT_EXPRS = tuple(f"dequant_bf16<{int(t)}>" for t in CUDA_DEQUANT_TYPES)
MOE_THREADS = 256  # 8 warps: a block's tile has at most 8 rows, one a warp
MOE_DOWN_ROWS = MOE_THREADS // 32  # rows of D a block of moe_down takes at most (for every pick)
MOE_SHARED_BYTES = 46 * 1024  # under the 48 KiB every card gives a block without opting in
MAX_EXPERTS = 4096  # experts a layer the grouped kernels' expert table covers
MOE_MAX_PICKS = 64  # moe_down's MAX_PICKS: experts a token it takes (its static shared tables: 576 bytes)
CUDA_ATTR_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
NO_HOST_POINTERS = "this device cannot read registered host memory at its host address"


class MoePlan(NamedTuple):
    """The fused decode kernels' launch shape for one expert layout."""

    ffn: int  # F: gate/up rows, down row length
    gate_row: int  # bytes of one gate (or up) row of D weights
    down_row: int  # bytes of one down row of F weights
    rows_gu: int  # rows a block of moe_gate_up stages (one a warp)
    rows_down: int  # rows a block of moe_down stages, for each of the A picks
    gate_up_shared: int  # bytes of shared memory a block of each takes
    down_shared: int
    q8_gate_up: bool  # the kernel dots integers: its input is quantized first (quantize_q8)
    q8_down: bool


class TorchKernels:
    """Plain torch: the oracle for the CUDA versions, and the path where those are missing."""

    name = "torch"

    def __init__(self):
        self.paths = PathCounter()  # "op:path" -> calls (eager and captured; see the module docstring)

    def describe(self) -> str:
        return self.name

    def expert_ids(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """0..n-1 (int64) on `device`: ids to search sorted picks with."""
        return torch.arange(n, device=device)

    def path_summary(self) -> str:
        return self.paths.summary()

    def copy_wide(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy src's bytes into dst (same byte count; either side may be mapped host memory)."""
        assert dst.numel() * dst.element_size() == src.numel() * src.element_size()
        self.paths.ran("copy_wide", "copy_engine")
        dst.view(torch.uint8).view(-1).copy_(src.contiguous().view(torch.uint8).view(-1), non_blocking=True)

    def dequant(self, src: torch.Tensor, ggml_type: GGMLQuantizationType, groups: int, weights_per_group: int,
                group_stride: int, out: torch.Tensor) -> None:
        """`groups` runs of blocks, `group_stride` bytes apart from src[0] -> out [groups * weights_per_group]."""
        self.paths.ran("dequant", "torch")
        fmt = block_format(ggml_type)
        run_bytes = weights_per_group // fmt.block_size * fmt.type_size
        runs = torch.as_strided(src, (groups, run_bytes), (group_stride, 1))
        blocks = runs.reshape(-1, fmt.type_size)  # one block per row
        values = dequantize_rows(blocks.contiguous(), ggml_type, fmt.block_size)
        out.copy_(values.reshape(-1))

    def dequant_experts(self, src: torch.Tensor, lay: ExpertLayout, n: int, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor) -> None:
        """n consecutive experts' raw bytes (arena layout) -> w_gate_up[:n] [n, 2F, D] and w_down[:n]
        [n, D, F]. Gate and up are adjacent in an expert: one run of 2*F*D weights."""
        self.dequant(src, lay.gate_type, n, 2 * lay.gate_weights, lay.expert_bytes,
                     w_gate_up.view(-1)[:n * 2 * lay.gate_weights])
        self.dequant(src[lay.down_offset:], lay.down_type, n, lay.down_weights, lay.expert_bytes,
                     w_down.view(-1)[:n * lay.down_weights])

    def dequant_addressed(self, addresses: torch.Tensor, sources: Callable[[], list[torch.Tensor]],
                          lay: ExpertLayout, n: int, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        """n experts, each wherever it lies on the device, -> w_gate_up[:n], w_down[:n]; `addresses` [n]
        device int64."""
        self.paths.ran("dequant_addressed", "torch")
        srcs = sources()
        if addresses.device.type == "cpu":  # the table CUDA would read points at these very bytes
            assert [s.data_ptr() for s in srcs] == addresses[:n].tolist(), "the address table is off"
        src = torch.cat(srcs) if n > 1 else srcs[0]
        self.dequant_experts(src, lay, n, w_gate_up, w_down)

    def gather_experts(self, cache: ResidentExperts, i: int, picks: torch.Tensor, lay: ExpertLayout,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        """Dequantize experts `picks` [M] of local layer i, wherever they live, into w_gate_up [M, 2F, D]
        and w_down [M, D, F]."""
        self.paths.ran("gather_experts", "torch")
        for g, e in enumerate(picks.tolist()):
            self.dequant_experts(cache.source(i, e), lay, 1, w_gate_up[g:g + 1], w_down[g:g + 1])

    def moe_gathered(self, cache: ResidentExperts, i: int, lay: ExpertLayout, h: torch.Tensor, weights: torch.Tensor,
                     experts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     hq: torch.Tensor | None = None) -> torch.Tensor:
        """Decode's routed experts of local layer i: h [T, D], weights [T, A] fp32, experts [T, A] -> [T, D]
        (a pick of -1 adds nothing: the host's cores compute it); hq: h quantized (`quantize_q8`) or None."""
        self.paths.ran("moe_gathered", "twin")
        t, a = experts.shape
        # a pick of -1 is the host's (stage.experts.handover): expert 0 at weight 0 here, no host sync
        weights, experts = torch.where(experts < 0, 0.0, weights.float()), experts.clamp(min=0)
        flat = experts.reshape(-1)  # [M]: row r * A + k is token r's k-th pick
        m = flat.numel()
        self.gather_experts(cache, i, flat, lay, w_gate_up, w_down)
        offs = torch.arange(1, m + 1, dtype=torch.int32, device=h.device)
        y = self.grouped_mlp(h.repeat_interleave(a, dim=0), offs, w_gate_up[:m], w_down[:m])  # [M, D]
        return torch.bmm(weights.to(y.dtype).unsqueeze(1), y.view(t, a, -1)).squeeze(1)  # as routing.combine

    def moe_fused_reference(self, cache: ResidentExperts, i: int, lay: ExpertLayout, h: torch.Tensor,
                            weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor) -> torch.Tensor:
        """The twin the fused decode kernels are held to: with bf16 input an integer side (Q8_DOT_TYPES)
        has its input quantized to 8 bits, as the kernels do; otherwise `moe_gathered`."""
        if h.dtype == torch.bfloat16 and {lay.gate_type, lay.down_type} & Q8_DOT_TYPES:
            return self._moe_picks_q8(cache, i, lay, h, weights, experts)
        return TorchKernels.moe_gathered(self, cache, i, lay, h, weights, experts, w_gate_up, w_down)

    def _moe_picks_q8(self, cache: ResidentExperts, i: int, lay: ExpertLayout, h: torch.Tensor, weights: torch.Tensor,
                      experts: torch.Tensor) -> torch.Tensor:
        """That side's input quantized to 8 bits (q8_values) times its weights dequantized in fp32; a
        float side as the grouped twin. Outputs rounded as the kernels round them."""
        d = h.shape[1]
        f = lay.gate_weights // d
        q8_in, q8_act = lay.gate_type in Q8_DOT_TYPES, lay.down_type in Q8_DOT_TYPES
        xs = q8_values(h) if q8_in else h.float()  # [T, D]
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for t, row in enumerate(experts.tolist()):
            for a, e in enumerate(row):
                src = cache.source(i, e)
                gu = dequantize_rows(src[:2 * lay.gate_bytes].reshape(2 * f, -1), lay.gate_type, d).to(h.device)
                wd = dequantize_rows(src[lay.down_offset:lay.down_offset + lay.down_bytes].reshape(d, -1),
                                     lay.down_type, f).to(h.device)
                y = _bf16r((gu if q8_in else _bf16r(gu)) @ xs[t])  # [2F]: gate, then up
                act = (_bf16r(F.silu(y[:f])) * y[f:]).bfloat16()  # [F]
                down = _bf16r((wd if q8_act else _bf16r(wd)) @ (q8_values(act[None])[0] if q8_act else act.float()))
                out[t] += _bf16r(weights[t, a].float()) * down  # the picks in order, as the kernel sums
        return out.bfloat16()

    def grouped_mlp(self, x: torch.Tensor, offs: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
                    ) -> torch.Tensor:
        """SiLU-gated MLP per group: x [M, D] sorted by group, offs [G] cumulative row ends,
        w_gate_up [G, 2F, D], w_down [G, D, F] -> [M, D]. Rows past offs[-1] are left unwritten."""
        self.paths.ran("grouped_mlp", "loop")
        out = torch.empty_like(x)
        ends = offs.tolist()
        f = w_down.shape[-1]
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                gu = x[start:end] @ w_gate_up[g].T  # [n, 2F]
                out[start:end] = (F.silu(gu[:, :f]) * gu[:, f:]) @ w_down[g].T
            start = end
        return out


@dataclass(frozen=True)
class CardCapabilities:
    """What the card lets the CUDA kernel set do, probed once (`probe`)."""

    host_pointers: bool  # kernels read registered host memory at its host address (UVA): decode relies on it
    grouped_mm: bool  # torch._grouped_mm works here
    grouped_mm_sync_free: bool  # ... without copying its offsets to the host (capturable)
    multiprocessors: int  # the card's SMs (what a launch's grid should fill)

    @classmethod
    def probe(cls, device: torch.device) -> CardCapabilities:
        cupy = nvrtc.require_cupy()
        grouped = _grouped_mm_works(device)
        # Below sm_90 torch._grouped_mm is a per-group loop that copies the offsets to the host
        # (pytorch/pytorch#186620): it works, but a step that uses it cannot be captured.
        uva = cupy.cuda.runtime.deviceGetAttribute(CUDA_ATTR_HOST_POINTER_FOR_REGISTERED_MEM, device.index or 0) == 1
        return cls(host_pointers=uva, grouped_mm=grouped,
                   grouped_mm_sync_free=grouped and torch.cuda.get_device_capability(device) >= (9, 0),
                   multiprocessors=torch.cuda.get_device_properties(device).multi_processor_count)


class CudaKernels(TorchKernels):
    """CUDA versions where the card (`caps`) and the call allow them, else the twin's. Made by
    `select_kernels`, which compiles the kernels first."""

    name = "cuda"

    def __init__(self, device: torch.device, caps: CardCapabilities):
        super().__init__()
        self.device = device
        self.use_grouped_mm = caps.grouped_mm
        self.grouped_mm_sync_free = caps.grouped_mm_sync_free
        self.host_pointers = caps.host_pointers
        self.multiprocessors = caps.multiprocessors
        self._expert_ids: torch.Tensor | None = None  # made by compile()

    def describe(self) -> str:
        return self.name + ("+grouped_mm" if self.use_grouped_mm else "")

    def compile(self) -> None:
        """Compile every kernel now, not in the middle of the first prompt."""
        device = self.device
        for expr in _DEQUANT_EXPRS:
            nvrtc.kernel(DEQUANT_FILE, expr, _DEQUANT_EXPRS, device)
        for expr in MOE_EXPRS:
            nvrtc.kernel(MOE_FILE, expr, MOE_EXPRS, device)
        for expr in grouped_exprs(Q8_DOT_TYPES):
            grouped_kernel(expr, device)
        # 0..MAX_EXPERTS, made once here: expert bounds and a part's group ends slice it (one launch
        # a layer fewer). Every stream of the device reads it, unordered: done before any does.
        self._expert_ids = torch.arange(MAX_EXPERTS + 1, device=device)
        torch.cuda.synchronize(device)
        nvrtc.kernel(COPY_FILE, "copy_f32_wide", (), device)

    def dequant(self, src: torch.Tensor, ggml_type: GGMLQuantizationType, groups: int, weights_per_group: int,
                group_stride: int, out: torch.Tensor) -> None:
        if not self._has_kernel(ggml_type, out):
            self.paths.fell_back("dequant", "cuda", self._no_kernel_reason(ggml_type, out))
            return super().dequant(src, ggml_type, groups, weights_per_group, group_stride, out)
        assert src.is_cuda
        self.paths.ran("dequant", "cuda")
        self._launch_dequant(ggml_type, src.data_ptr(), None, 0, groups, weights_per_group, group_stride, out)

    def dequant_addressed(self, addresses: torch.Tensor, sources: Callable[[], list[torch.Tensor]],
                          lay: ExpertLayout, n: int, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        if not (self._has_kernel(lay.gate_type, w_gate_up) and self._has_kernel(lay.down_type, w_down)):
            reason = self._no_kernel_reason(lay.gate_type, w_gate_up) or self._no_kernel_reason(lay.down_type, w_down)
            self.paths.fell_back("dequant_addressed", "cuda", reason)
            return super().dequant_addressed(addresses, sources, lay, n, w_gate_up, w_down)
        self.paths.ran("dequant_addressed", "cuda")
        self._dequant_by_address(addresses.contiguous(), lay, n, w_gate_up, w_down)

    def gather_experts(self, cache: ResidentExperts, i: int, picks: torch.Tensor, lay: ExpertLayout,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        if not (self.host_pointers and self._has_kernel(lay.gate_type, w_gate_up)
                and self._has_kernel(lay.down_type, w_down)):
            reason = (NO_HOST_POINTERS if not self.host_pointers else
                      self._no_kernel_reason(lay.gate_type, w_gate_up) or self._no_kernel_reason(lay.down_type, w_down))
            self.paths.fell_back("gather_experts", "cuda", reason)
            return super().gather_experts(cache, i, picks, lay, w_gate_up, w_down)
        self.paths.ran("gather_experts", "cuda")
        # [M] addresses built on the device: no host sync
        self._dequant_by_address(cache.addresses(i, picks), lay, picks.numel(), w_gate_up, w_down)

    def _dequant_by_address(self, addresses: torch.Tensor, lay: ExpertLayout, n: int, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor) -> None:
        self._launch_dequant(lay.gate_type, 0, addresses, 0, n, 2 * lay.gate_weights, 0, w_gate_up[:n].view(-1))
        self._launch_dequant(lay.down_type, 0, addresses, lay.down_offset, n, lay.down_weights, 0, w_down[:n].view(-1))

    def moe_fused(self, lay: ExpertLayout, hidden: int, n_used: int) -> MoePlan | None:
        """The fused decode kernels' plan for this layout, or None (a type without a kernel, tiles too
        big for shared memory)."""
        if not (self.host_pointers and block_format(lay.gate_type).fused_decode
                and block_format(lay.down_type).fused_decode and n_used <= MOE_MAX_PICKS):
            return None
        ffn = lay.gate_weights // hidden
        gate_row, down_row = lay.gate_bytes // ffn, lay.down_bytes // hidden
        gate_vector = _vector_bytes(hidden, lay.gate_type)
        rows_gu = min(((MOE_SHARED_BYTES - gate_vector) // 2 - 32) // gate_row, MOE_THREADS // 32)
        rows_down = max((r for r in range(1, min(MOE_DOWN_ROWS, MOE_THREADS // 32) + 1)
                         if _down_shared(r, down_row, ffn, n_used, lay.down_type) <= MOE_SHARED_BYTES), default=0)
        if rows_gu < 1 or rows_down < 1:
            return None
        return MoePlan(ffn=ffn, gate_row=gate_row, down_row=down_row, rows_gu=rows_gu, rows_down=rows_down,
                       gate_up_shared=2 * _tile_room(rows_gu * gate_row) + gate_vector,
                       down_shared=_down_shared(rows_down, down_row, ffn, n_used, lay.down_type),
                       q8_gate_up=lay.gate_type in Q8_DOT_TYPES, q8_down=lay.down_type in Q8_DOT_TYPES)

    def moe_gathered(self, cache: ResidentExperts, i: int, lay: ExpertLayout, h: torch.Tensor, weights: torch.Tensor,
                     experts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     hq: torch.Tensor | None = None) -> torch.Tensor:
        """Two launches straight from the experts' quantized bytes: no workspace, no host sync."""
        t, a = experts.shape
        d = h.shape[1]
        plan = self.moe_fused(lay, d, a) if h.dtype == torch.bfloat16 else None
        if plan is None:
            self.paths.fell_back("moe_gathered", "fused", self._not_fused_reason(lay, h, a))
            return super().moe_gathered(cache, i, lay, h, weights, experts, w_gate_up, w_down)
        h, picks, weights = h.contiguous(), experts.reshape(-1).contiguous(), weights.float().contiguous()
        n_experts = cache.slot_of.shape[1]
        # layer i's rows of the cache's tables, and its base addresses: where each expert's bytes are
        table = (np.uint64(cache.slot_of.data_ptr() + 8 * i * n_experts),
                 np.uint64(cache.host_offset.data_ptr() + 8 * i * n_experts), np.uint64(cache.slots.data_ptr()),
                 np.int64(cache.slot_bytes), np.uint64(cache.host.data_ptr()))
        if not (hq is not None and hq.shape == (t, d // 32 * Q8_WORDS) and hq.dtype == torch.int32):
            hq = self._quantize_q8(h) if plan.q8_gate_up else None
        if self._goes_grouped(plan, cache, t * a, d):
            assert hq is not None, "the grouped kernels dot integers: h was quantized"
            self.paths.ran("moe_gathered", "grouped")
            return moe_grouped(self.device, self.expert_ids(n_experts + 1), table, lay, hq, weights, experts)
        self.paths.ran("moe_gathered", "fused")
        f = plan.ffn
        act = torch.empty(t * a, f, dtype=torch.bfloat16, device=h.device)
        out = torch.empty(t, d, dtype=torch.bfloat16, device=h.device)
        gate_in = hq if plan.q8_gate_up else h  # the float kernels read h itself
        assert gate_in is not None
        fn = nvrtc.kernel(MOE_FILE, f"moe_gate_up<{int(lay.gate_type)}>", MOE_EXPRS, self.device)
        nvrtc.launch(fn, (-(-f // plan.rows_gu), t * a), MOE_THREADS,
                     (h.data_ptr(), gate_in.data_ptr(), picks.data_ptr(), np.int32(a), *table, np.int32(d), np.int32(f),
                      np.int64(plan.gate_row), np.int32(plan.rows_gu), act.data_ptr()), self.device,
                     shared_mem=plan.gate_up_shared)
        aq = self._quantize_q8(act) if plan.q8_down else act
        fn = nvrtc.kernel(MOE_FILE, f"moe_down<{int(lay.down_type)}>", MOE_EXPRS, self.device)
        nvrtc.launch(fn, (-(-d // plan.rows_down), t), MOE_THREADS,
                     (act.data_ptr(), aq.data_ptr(), picks.data_ptr(), weights.data_ptr(), np.int32(a), *table,
                      np.int32(d), np.int32(f), np.int64(plan.down_row), np.int64(lay.down_offset),
                      np.int32(plan.rows_down), out.data_ptr()), self.device, shared_mem=plan.down_shared)
        return out

    @staticmethod
    def grouped_serves(plan: MoePlan, hidden: int) -> bool:
        return (plan.q8_gate_up and plan.q8_down and vectors_a_batch(hidden, Q8_WORDS) > 0
                and vectors_a_batch(plan.ffn, Q8_WORDS) > 0)

    def _goes_grouped(self, plan: MoePlan, cache: ResidentExperts, n_picks: int, hidden: int) -> bool:
        """Expert by expert rather than pick by pick: enough picks that experts repeat, every expert in
        VRAM (the grouped kernels' narrow loads do not suit mapped host memory), and a layout they take."""
        n_experts = cache.slot_of.shape[1]
        return (n_picks >= GROUPED_MIN_PICKS and n_experts <= MAX_EXPERTS and cache.per_layer >= n_experts
                and self.grouped_serves(plan, hidden))

    def expert_ids(self, n: int, device: torch.device | str | None = None) -> torch.Tensor:
        if self._expert_ids is None or n > self._expert_ids.numel():
            return super().expert_ids(n, self.device)
        return self._expert_ids[:n]

    def _quantize_q8(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_q8(x, self.device)

    def copy_wide(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`copy_f32_wide`: a kernel's 16-byte loads, so a hand-over through mapped host memory never
        waits behind the copy engines' expert uploads."""
        nbytes = src.numel() * src.element_size()
        assert dst.numel() * dst.element_size() == nbytes and src.is_contiguous() and dst.is_contiguous()
        if not self.host_pointers or nbytes % 16 or src.data_ptr() % 16 or dst.data_ptr() % 16:
            self.paths.fell_back("copy_wide", "copy_f32_wide", NO_HOST_POINTERS if not self.host_pointers else
                                 "byte count or an address is not a multiple of 16")
            return super().copy_wide(dst, src)
        self.paths.ran("copy_wide", "copy_f32_wide")
        fn = nvrtc.kernel(COPY_FILE, "copy_f32_wide", (), self.device)
        n4 = nbytes // 16
        nvrtc.launch(fn, min((n4 + 255) // 256, 4096), 256,
                            (np.uint64(src.data_ptr()), np.uint64(dst.data_ptr()), np.int64(n4)), self.device)

    @staticmethod
    def _has_kernel(ggml_type: GGMLQuantizationType, out: torch.Tensor) -> bool:
        return block_format(ggml_type).cuda_dequant and out.dtype == torch.bfloat16

    @staticmethod
    def _no_kernel_reason(ggml_type: GGMLQuantizationType, out: torch.Tensor) -> str:
        if not block_format(ggml_type).cuda_dequant:
            return f"{ggml_type.name} has no CUDA dequant"
        return "" if out.dtype == torch.bfloat16 else f"the output is {out.dtype}; the kernel writes bfloat16"

    def _not_fused_reason(self, lay: ExpertLayout, h: torch.Tensor, n_used: int) -> str:
        if h.dtype != torch.bfloat16:
            return f"activations are {h.dtype}; the kernels take bfloat16"
        if not self.host_pointers:
            return NO_HOST_POINTERS
        for t in (lay.gate_type, lay.down_type):
            if not block_format(t).fused_decode:
                return f"{t.name} has no fused decode kernel"
        if n_used > MOE_MAX_PICKS:
            return f"{n_used} experts a token (the kernels take at most {MOE_MAX_PICKS})"
        return f"a row tile of {lay.gate_type.name}/{lay.down_type.name} experts does not fit shared memory"

    def _launch_dequant(self, ggml_type: GGMLQuantizationType, src_ptr: int, addresses: torch.Tensor | None,
                        ptr_offset: int, groups: int, weights_per_group: int, group_stride: int,
                        out: torch.Tensor) -> None:
        assert out.is_cuda and out.is_contiguous() and out.numel() == groups * weights_per_group
        assert weights_per_group % 32 == 0
        assert addresses is None or (addresses.dtype == torch.int64 and addresses.numel() == groups)
        fn = nvrtc.kernel(DEQUANT_FILE, f"dequant_bf16<{int(ggml_type)}>", _DEQUANT_EXPRS, self.device)
        n_sub = groups * weights_per_group // 32
        block = 256
        assert groups <= 65535, "one run a grid row: at most 65,535 runs a launch"
        grid = (min(-(-(weights_per_group // 32) // block), 65535), groups)
        table = addresses.data_ptr() if addresses is not None else 0
        nvrtc.launch(fn, grid, block, (np.uint64(src_ptr), out.data_ptr(), np.int64(n_sub),
                                              np.int64(weights_per_group // 32), np.int64(group_stride),
                                              np.uint64(table), np.int64(ptr_offset)), self.device)

    def grouped_mlp(self, x: torch.Tensor, offs: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
                    ) -> torch.Tensor:
        if not self.use_grouped_mm or x.dtype != torch.bfloat16:
            self.paths.fell_back("grouped_mlp", "grouped_mm", "torch._grouped_mm does not work on this device"
                                 if not self.use_grouped_mm else f"activations are {x.dtype}; it takes bfloat16")
            return super().grouped_mlp(x, offs, w_gate_up, w_down)
        self.paths.ran("grouped_mlp", "grouped_mm")
        f = w_down.shape[-1]
        gu = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=offs)  # [M, 2F]
        act = F.silu(gu[:, :f]) * gu[:, f:]  # [M, F]
        return torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs)  # [M, D]


def q8_values(x: torch.Tensor) -> torch.Tensor:
    """What the integer kernels multiply for x [R, n] (n a multiple of 32): each run of 32 values
    quantized to q in [-127, 127] with dx = max|x| / 127 (fp32), q = round-half-even(x / dx),
    returned as fp32 q * dx."""
    runs = x.float().reshape(-1, 32)
    amax = runs.abs().amax(1, keepdim=True)
    dx = amax / torch.full_like(amax, 127.0)  # true division on CUDA too (quant.quantize.quantize_q8_0 says why)
    q = torch.where(dx > 0, torch.round(runs / torch.where(dx > 0, dx, 1.0)), 0.0)
    return (q * dx).reshape(x.shape)


def _bf16r(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, kept in fp32 (the kernels' bf16r)."""
    return x.bfloat16().float()


def _tile_room(nbytes: int) -> int:
    """Shared memory for a staged tile of `nbytes` (moe_decode.cu's tile_room)."""
    return (nbytes + 15) // 16 * 16 + 16


def _vector_bytes(n: int, ggml_type: GGMLQuantizationType) -> int:
    """Shared memory for a staged vector of n values (moe_decode.cu's vector_words): Q8_WORDS words a
    32-value sub-block quantized, else 17 (bf16 pairs; the odd stride keeps lanes on distinct banks)."""
    return n // 32 * (Q8_WORDS if ggml_type in Q8_DOT_TYPES else 17) * 4


def _down_shared(rows: int, down_row: int, ffn: int, n_used: int, down_type: GGMLQuantizationType) -> int:
    return n_used * (_tile_room(rows * down_row) + _vector_bytes(ffn, down_type)) + 4 * rows * n_used


def _grouped_mm_works(device: torch.device) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(24, 64, device=device, dtype=torch.bfloat16)
        w = torch.randn(3, 32, 64, device=device, dtype=torch.bfloat16)
        offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        ref = torch.cat([x[:8] @ w[0].T, x[8:24] @ w[2].T])
        return bool(torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError) as e:
        log.info("torch._grouped_mm unavailable on %s: %s", device, e)
        return False


def select_kernels(device: torch.device, *, prefer_cuda: bool = True) -> TorchKernels:
    """The kernel set for a stage on `device`. Without CuPy (or a kernel source) on a CUDA device:
    the torch twins, with one warning a process saying what is lost."""
    if device.type != "cuda" or not prefer_cuda:
        return TorchKernels()
    try:
        nvrtc.require_cupy()
        kernels = CudaKernels(device, CardCapabilities.probe(device))
        kernels.compile()
    except nvrtc.KernelUnavailable as e:
        warn_once("CUDA kernels unavailable, the stage runs the torch twins (no CUDA dequant, no fused decode "
                  "experts or decode ops, hand-overs by copy engine: slower prompts and decode)", str(e))
        return TorchKernels()
    log.info("kernels on %s: CUDA dequant, grouped GEMM %s", device,
             "torch._grouped_mm" if kernels.use_grouped_mm else "per-expert loop")
    return kernels
