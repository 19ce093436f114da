"""The decode step's small ops as fused CUDA kernels (`cuda_src/decode_ops.cu`).

`model.reference.DecodeOps` is the twin. Each op here replaces three to ten torch launches:
RMSNorm (with the residual add before it), q/k head norms + RoPE + the KV cache write, router
logits, softmax + top-k + renormalization. A call these kernels do not cover (another dtype, a
head dim that is not a multiple of 64, more than 512 experts) goes to the twin: counted in
`paths` ("rms_norm:cuda", "rms_norm:twin", ...; see `kernels.paths`) and warned once with the
reason. A prompt's many rows route by the twin's GEMM by design ("route:gemm", no warning).
"""

from __future__ import annotations

import numpy as np
import torch

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.paths import PathCounter
from strata_mgpu.model.decoder import DecodeOps
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.weights import LayerWeights

OPS_FILE = "decode_ops.cu"
KERNEL_NAMES = ("rms_norm_rows", "add_rms_norm_rows", "qk_norm_rope_kv", "router_logits", "route_topk")
NORM_THREADS = 256
ROUTER_WARPS = 8
MAX_EXPERTS = 512  # route_topk holds 16 values a lane
MAX_ROUTED_ROWS = 64  # router_logits re-reads the router for every row: a prompt's rows go to the GEMM
NOT_BF16 = "a tensor is not a contiguous bfloat16 CUDA tensor"


class CudaDecodeOps(DecodeOps):
    """The fused decode ops on `device`. `paths`: where to count which path each call took (a
    stage passes its expert kernels' counter, so one report shows both)."""

    def __init__(self, device: torch.device, paths: PathCounter | None = None):
        self.device = device
        self.paths = PathCounter() if paths is None else paths
        self._fn = {name: nvrtc.kernel(OPS_FILE, name, (), device) for name in KERNEL_NAMES}

    def _twin(self, op: str, reason: str) -> None:
        self.paths.fell_back(op, "cuda", reason)
        self.paths.ran(op, "twin")

    def _launch(self, name: str, grid, block: int, *args) -> None:
        nvrtc.launch(self._fn[name], grid, block, args, self.device)

    @staticmethod
    def _ok(*tensors: torch.Tensor) -> bool:
        return all(t.is_cuda and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._ok(x, weight):
            self._twin("rms_norm", NOT_BF16)
            return super().rms_norm(x, weight, eps)
        self.paths.ran("rms_norm", "cuda")
        out = torch.empty_like(x)
        n = x.shape[-1]
        self._launch("rms_norm_rows", x.numel() // n, NORM_THREADS, x.data_ptr(), weight.data_ptr(), np.int32(n),
                     np.float32(eps), out.data_ptr())
        return out

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self._ok(x, y, weight) and x.shape == y.shape):
            self._twin("add_rms_norm", NOT_BF16 if x.shape == y.shape else "x and y differ in shape")
            return super().add_rms_norm(x, y, weight, eps)
        self.paths.ran("add_rms_norm", "cuda")
        out = torch.empty_like(x)
        n = x.shape[-1]
        self._launch("add_rms_norm_rows", x.numel() // n, NORM_THREADS, x.data_ptr(), y.data_ptr(),
                     weight.data_ptr(), np.int32(n), np.float32(eps), out.data_ptr())
        return x, out

    def qk_norm_rope_kv(self, spec: ModelSpec, w: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        position: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor) -> torch.Tensor:
        dh = spec.head_dim
        if not (self._ok(q, k, v, w.q_norm, w.k_norm, k_cache, v_cache) and dh % 64 == 0 and dh <= 256
                and q.shape[0] == 1 and position.dtype == torch.int64):
            self._twin("qk_norm_rope_kv", NOT_BF16 if not self._ok(q, k, v, w.q_norm, w.k_norm, k_cache, v_cache)
                       else f"head dim {dh} (multiples of 64 up to 256), more than one row, or a position not int64")
            return super().qk_norm_rope_kv(spec, w, q, k, v, position, cos, sin, k_cache, v_cache)
        self.paths.ran("qk_norm_rope_kv", "cuda")
        self._launch("qk_norm_rope_kv", spec.n_heads + 2 * spec.n_kv_heads, 32, q.data_ptr(), k.data_ptr(),
                     v.data_ptr(), w.q_norm.data_ptr(), w.k_norm.data_ptr(), np.int32(spec.n_heads),
                     np.int32(spec.n_kv_heads), np.int32(dh), position.data_ptr(), np.float32(spec.rope_base),
                     np.float32(spec.rms_eps), k_cache.data_ptr(), v_cache.data_ptr())
        return q.view(1, spec.n_heads, dh)  # normed and rotated in place

    def route(self, h: torch.Tensor, router: torch.Tensor, n_used: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        e, d = router.shape
        if h.shape[0] > MAX_ROUTED_ROWS:  # a prompt's rows: the GEMM is the right tool, not a fallback
            self.paths.ran("route", "gemm")
            return super().route(h, router, n_used, renormalize)
        if not (self._ok(h) and router.dtype == torch.float32 and router.is_contiguous() and e <= MAX_EXPERTS
                and n_used <= min(32, e)):
            self._twin("route", NOT_BF16 if not self._ok(h) else f"router {router.dtype} (contiguous fp32), "
                       f"{e} experts (<= {MAX_EXPERTS}) or {n_used} picks (<= 32)")
            return super().route(h, router, n_used, renormalize)
        self.paths.ran("route", "cuda")
        t = h.shape[0]
        logits = torch.empty(t, e, dtype=torch.float32, device=h.device)
        weights = torch.empty(t, n_used, dtype=torch.float32, device=h.device)
        experts = torch.empty(t, n_used, dtype=torch.int64, device=h.device)
        self._launch("router_logits", (-(-e // ROUTER_WARPS), t), 32 * ROUTER_WARPS, h.data_ptr(), router.data_ptr(),
                     np.int32(d), np.int32(e), logits.data_ptr())
        self._launch("route_topk", t, 32, logits.data_ptr(), np.int32(e), np.int32(n_used), np.int32(renormalize),
                     weights.data_ptr(), experts.data_ptr())
        return weights, experts
