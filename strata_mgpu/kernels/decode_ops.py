"""The decode step's small ops as fused CUDA kernels (`cuda_src/decode_ops.cu`,
`cuda_src/decode_attention.cu`); `model.ops.DecodeOps` is the twin.

A call these kernels do not cover (another dtype, a head dim not a multiple of 64, more than 512
experts, caches in another `KVFormat` than the ops were built for) goes to the twin: counted in
`paths` and warned once with the reason. A prompt's many rows route by the twin's GEMM by design
("route:gemm", no warning). The ops are built for one pair of cache types (`kv_types`), whose
kernels `qk_norm_rope_kv` quantizes into and `attn_split` dequantizes in its tile loads.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.paths import PathCounter
from strata_mgpu.kernels.q8 import Q8_WORDS
from strata_mgpu.model.kv_cache import PLAIN_KV, KVFormat, SequenceKV
from strata_mgpu.model.ops import DecodeOps, block_table
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.model.weights import LayerWeights

Q = GGMLQuantizationType
KVTypes = tuple[GGMLQuantizationType, GGMLQuantizationType]  # (keys, values): how a cache stores them
OPS_FILE = "decode_ops.cu"
# qk_norm_rope_kv's variant for each pair of cache types (keys, values): Q8_0 ones quantize on the way
QK_NORM_ROPE_KV = {(Q.BF16, Q.BF16): "qk_norm_rope_kv", (Q.Q8_0, Q.BF16): "qk_norm_rope_kv_k8",
                   (Q.BF16, Q.Q8_0): "qk_norm_rope_kv_v8", (Q.Q8_0, Q.Q8_0): "qk_norm_rope_kv_k8v8"}
KERNEL_NAMES = ("rms_norm_rows", "add_rms_norm_rows", *QK_NORM_ROPE_KV.values(), "route_rows", "moe_input_rows")
MOE_INPUT_SHARED_BYTES = 46 * 1024  # moe_input_rows keeps a row of D fp32 in shared memory: D <= 11,776
NORM_THREADS = 256
ROUTER_WARPS = 8
MAX_EXPERTS = 512  # route_rows' top-k holds 16 values a lane
MAX_ROUTED_ROWS = 64  # route_rows re-reads the router for every row: a prompt's rows go to the GEMM
NOT_BF16 = "a tensor is not a contiguous bfloat16 CUDA tensor"
ATTN_FILE = "decode_attention.cu"
ATTN_HEAD_DIMS = (64, 128, 256)


def attn_split_expr(head_dim: int, kv_types: KVTypes) -> str:
    q8 = ("true" if t == Q.Q8_0 else "false" for t in kv_types)
    return f"attn_split<{head_dim}, {', '.join(q8)}>"


def attn_exprs(kv_types: KVTypes) -> tuple[str, ...]:
    return tuple(e for d in ATTN_HEAD_DIMS for e in (attn_split_expr(d, kv_types), f"attn_combine<{d}>"))


ATTN_EXPRS = attn_exprs(PLAIN_KV)
ATTN_ALL_EXPRS = tuple(dict.fromkeys(e for types in QK_NORM_ROPE_KV for e in attn_exprs(types)))  # every variant
ATTN_WARPS = 2  # decode_attention.cu's WARPS: warps of attn_split, each streaming its own tiles of keys
ATTN_HEADS_AT_ONCE = 8  # its HC: query heads a block of attn_split takes; a wider group spans blocks
ATTN_COMBINE_GROUPS = 8  # its CG: attn_combine's threads are head_dim / 4 dims x this many groups of splits
# keys a split takes at least (4 tiles: 2 a warp; decode_attention.cu's SPLIT_GRANULE, given it); more once a
# cache passes ATTN_SPLITS of them. A row shorter than the capacity spreads its own keys over the
# splits (row_split_keys there).
ATTN_MIN_KEYS = 32
ATTN_DEFINES = (("SPLIT_GRANULE", ATTN_MIN_KEYS),)  # what decode_attention.cu is compiled with
ATTN_SPLITS = 128
ATTN_MIN_CAPABILITY = (8, 0)  # mma.sync on bf16 and cp.async
KV_TABLES = 64  # batches whose cache table is kept (a capture replays the table it was given)
KV_TABLE_COLUMNS = 5  # kv_table_row's
# a paged cache's block tokens: a power of two at least this (a multiple of decode_attention.cu's TK = 8
# keys a tile, whose cells then sit in one block)
MIN_BLOCK_TOKENS = 16


def attention_split(capacity: int) -> int:
    """Keys one block of attn_split takes for caches of up to `capacity` cells: ATTN_MIN_KEYS, or a
    multiple of it keeping the splits at most ATTN_SPLITS (a block's shared memory does not grow)."""
    return max(ATTN_MIN_KEYS, -(-capacity // ATTN_SPLITS // ATTN_MIN_KEYS) * ATTN_MIN_KEYS)


def kv_table_row(kv: SequenceKV) -> tuple[int, int, int, int, int]:
    """A cache as the kernels find it (a row of `CudaDecodeOps.kv_table`): its keys' and values' base
    addresses, its keys' layer stride in their elements (bytes where Q8_0), its block table's address
    and log2 of its block tokens (both 0 for a contiguous cache, whose cell is the position)."""
    paged = block_table(kv)
    table, shift = (0, 0) if paged is None else (paged[0].data_ptr(), paged[1].bit_length() - 1)
    return kv.k.data_ptr(), kv.v.data_ptr(), kv.k.stride(0), table, shift


def distinct(kvs: Sequence[SequenceKV]) -> list[SequenceKV]:
    """Each cache once: a prompt's rows repeat their cache, and checking each row's would cost host
    time per row and layer."""
    return list({id(kv): kv for kv in kvs}.values())


class CudaDecodeOps(DecodeOps):
    """The fused decode ops on `device`, for caches that store (keys, values) as `kv_types`. `paths`:
    where to count which path each call took."""

    kv_types: KVTypes = PLAIN_KV
    _format = KVFormat(torch.bfloat16, *PLAIN_KV)  # what _caches_ok compares each cache with

    def __init__(self, device: torch.device, paths: PathCounter | None = None, kv_types: KVTypes = PLAIN_KV):
        self.device = device
        self.paths = PathCounter() if paths is None else paths
        self.kv_types = kv_types
        self._format = KVFormat(torch.bfloat16, *kv_types)
        exprs = attn_exprs(kv_types)
        self._fn = {name: nvrtc.kernel(OPS_FILE, name, (), device) for name in KERNEL_NAMES}
        self._fn.update({name: nvrtc.kernel(ATTN_FILE, name, exprs, device, ATTN_DEFINES) for name in exprs})
        # older cards load decode_attention.cu (its kernels trap there) but run the twin
        self._attention_arch_ok = torch.cuda.get_device_capability(device) >= ATTN_MIN_CAPABILITY
        self._tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        # route_rows' and moe_input_rows' counters of finished blocks a row: zero between launches
        # (each row's last block resets its own), made here, never inside a graph capture; one
        # stream at a time uses them (the ops are a stage's, on its compute stream)
        self.rows_done = torch.zeros(MAX_ROUTED_ROWS, dtype=torch.int32, device=device)

    def twin_runs(self, ops: Sequence[str]) -> list[int]:
        return [self.paths[f"{op}:twin"] for op in ops]

    def _twin(self, op: str, reason: str) -> None:
        self.paths.fell_back(op, "cuda", reason)
        self.paths.ran(op, "twin")

    def _launch(self, name: str, grid, block: int, *args, shared_mem: int = 0) -> None:
        nvrtc.launch(self._fn[name], grid, block, args, self.device, shared_mem=shared_mem)

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

    @staticmethod
    def _rows_ok(t: torch.Tensor) -> bool:
        """A bf16 CUDA matrix whose rows are contiguous (it may be a column block of a wider one)."""
        return t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1

    def kv_table(self, kvs: Sequence[SequenceKV]) -> torch.Tensor:
        """[B, KV_TABLE_COLUMNS] int64 on the device, row b `kv_table_row(kvs[b])`. Made eagerly and kept: a
        graph capture (which may not copy from the host) finds the table its warm-up step made; a cache
        that moves is a new key. A paged cache's row names its block table's address, not the blocks:
        a captured step reads the table's contents of each replay."""
        key = tuple(kv_table_row(kv) for kv in kvs)
        table = self._tables.get(key)
        if table is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a KV table is made outside a capture: run the step once eagerly first")
            # from pinned memory without a host wait: a prompt through the fused ops (`Decoder.static_rows`)
            # makes a table for its new cache, and a pageable copy would wait for the work queued before it
            host = torch.tensor(key, dtype=torch.int64)
            host = host.pin_memory() if self.device.type == "cuda" else host
            table = host.to(self.device, non_blocking=True).view(len(kvs), KV_TABLE_COLUMNS)
            self._tables[key] = table
            while len(self._tables) > KV_TABLES:
                self._tables.popitem(last=False)
        self._tables.move_to_end(key)
        return table

    def _stored_ok(self, t: torch.Tensor, stored: GGMLQuantizationType) -> bool:
        return t.is_cuda and t.is_contiguous() and t.dtype == torch.uint8 if stored == Q.Q8_0 else self._ok(t)

    @staticmethod
    def _blocks_ok(kv: SequenceKV) -> bool:
        """Contiguous, or a paged cache the kernels can read: its table int32 on the cache's device, entries
        for its whole capacity, blocks of a power of two >= MIN_BLOCK_TOKENS cells (no tile straddles two)."""
        paged = block_table(kv)
        if paged is None:
            return True
        table, b = paged
        return (table.device == kv.k.device and table.dtype == torch.int32 and table.dim() == 1
                and table.is_contiguous() and b >= MIN_BLOCK_TOKENS and b & (b - 1) == 0
                and table.numel() * b >= kv.capacity)

    def _caches_ok(self, kvs: Sequence[SequenceKV], kv_heads: int, head_dim: int) -> bool:
        """Every cache in the format these ops were built for: [layers, cells, kv_heads, head_dim] bf16
        (or head_dim / 32 * 34 bytes where Q8_0), contiguous on the device (a paged cache's: the pool's
        storage, its block table as `_blocks_ok` wants it)."""
        want = self._format
        return all(kv.format == want and self._stored_ok(kv.k, want.keys) and self._stored_ok(kv.v, want.values)
                   and kv.k.shape[2:] == (kv_heads, want.row(want.keys, head_dim)) and kv.k.shape[:2] == kv.v.shape[:2]
                   and kv.v.shape[2:] == (kv_heads, want.row(want.values, head_dim)) and self._blocks_ok(kv)
                   for kv in distinct(kvs))

    def qk_norm_rope_kv(self, spec: ModelSpec, w: LayerWeights, layer: int, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        kvs: Sequence[SequenceKV], table: torch.Tensor | None = None) -> torch.Tensor:
        dh, n, rot = spec.head_dim, len(kvs), spec.rotary_dim  # the first `rot` dims of a head rotate
        assert w.q_norm is not None and w.k_norm is not None, "an attention layer"
        tensors_ok = (self._ok(w.q_norm, w.k_norm, cos, sin) and cos.shape == sin.shape == (n, rot)
                      and rot % 2 == 0 and 0 < rot <= dh
                      and self._caches_ok(kvs, spec.n_kv_heads, dh) and all(self._rows_ok(t) for t in (q, k, v)))
        if not (tensors_ok and dh % 64 == 0 and dh <= 256 and positions.dtype == torch.int64
                and positions.is_contiguous() and q.shape[0] == n):
            self._twin("qk_norm_rope_kv", NOT_BF16 + " (or cos/sin not [B, rotated dims], a cache of another format or "
                       "a block table the kernels cannot read)"
                       if not tensors_ok
                       else f"head dim {dh} (multiples of 64 up to 256), positions not int64, or {q.shape[0]} "
                       f"rows for {n} caches")
            return super().qk_norm_rope_kv(spec, w, layer, q, k, v, positions, cos, sin, kvs, table)
        self.paths.ran("qk_norm_rope_kv", "cuda")
        q_out = torch.empty(n, spec.n_heads, dh, dtype=q.dtype, device=q.device)
        self._launch(QK_NORM_ROPE_KV[self.kv_types], (spec.n_heads + 2 * spec.n_kv_heads, n), 32,
                     q.data_ptr(), np.int64(q.stride(0)), k.data_ptr(), np.int64(k.stride(0)), v.data_ptr(),
                     np.int64(v.stride(0)), w.q_norm.data_ptr(), w.k_norm.data_ptr(), np.int32(spec.n_heads),
                     np.int32(spec.n_kv_heads), np.int32(dh), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     np.int32(rot), np.float32(spec.rms_eps),
                     (self.kv_table(kvs) if table is None else table).data_ptr(), np.int32(layer), q_out.data_ptr())
        return q_out

    def attention(self, layer: int, q: torch.Tensor, positions: torch.Tensor, kvs: Sequence[SequenceKV],
                  table: torch.Tensor | None = None, capacity: int | None = None) -> torch.Tensor:
        n, h, dh = q.shape
        hkv = kvs[0].k.shape[2]
        # cells the splits cover: every cache's, or what a graph's replays may read (their positions)
        capacity = max(kv.capacity for kv in kvs) if capacity is None else capacity
        tensors_ok = self._ok(q) and self._caches_ok(kvs, hkv, dh)
        aligned = all(t.data_ptr() % 16 == 0 for t in (q, *(c for kv in distinct(kvs) for c in (kv.k, kv.v))))
        if not (tensors_ok and self._attention_arch_ok and dh in ATTN_HEAD_DIMS and h % hkv == 0 and aligned
                and positions.dtype == torch.int64 and positions.is_contiguous()):
            self._twin("attention", NOT_BF16 + " (or a cache of another format or a block table the kernels "
                       "cannot read)" if not tensors_ok else
                       f"compute capability below {ATTN_MIN_CAPABILITY}" if not self._attention_arch_ok else
                       f"head dim {dh} (one of {ATTN_HEAD_DIMS}), {h} query heads over {hkv} KV heads, "
                       "q or a cache not 16-byte aligned, or positions not int64")
            return super().attention(layer, q, positions, kvs, table, capacity)
        self.paths.ran("attention", "cuda")
        keys = attention_split(capacity)
        splits = -(-capacity // keys)
        part_o = torch.empty(n, h, splits, dh, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(n, h, splits, 2, dtype=torch.float32, device=q.device)
        out = torch.empty_like(q)
        table = self.kv_table(kvs) if table is None else table
        chunks = -(-(h // hkv) // ATTN_HEADS_AT_ONCE)  # blocks a KV head's group of query heads takes
        self._launch(attn_split_expr(dh, self.kv_types), (hkv * chunks, splits, n), 32 * ATTN_WARPS, q.data_ptr(),
                     table.data_ptr(), np.int32(layer), positions.data_ptr(), np.int32(h), np.int32(hkv),
                     np.float32(1 / math.sqrt(dh)), np.int32(keys), np.int32(splits), part_o.data_ptr(),
                     part_ml.data_ptr())
        self._launch(f"attn_combine<{dh}>", (h, n), dh // 4 * ATTN_COMBINE_GROUPS, part_o.data_ptr(),
                     part_ml.data_ptr(), positions.data_ptr(), np.int32(h), np.int32(keys), np.int32(splits),
                     out.data_ptr())
        return out

    def moe_input(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, router: torch.Tensor,
                  n_used: int, renormalize: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """add_rms_norm + route + the experts' quantized input in one launch, where add_rms_norm and route
        would each take their fused kernel; else those two."""
        e = router.shape[0]
        if not (x.dim() == 2 and x.shape == y.shape and weight.numel() == x.shape[1] == router.shape[1]
                and self._ok(x, y, weight) and router.dtype == torch.float32 and router.is_contiguous()
                and router.data_ptr() % 16 == 0 and e <= MAX_EXPERTS and n_used <= min(32, e)
                and x.shape[0] <= MAX_ROUTED_ROWS and x.shape[1] % 32 == 0
                and 4 * x.shape[1] <= MOE_INPUT_SHARED_BYTES):
            return super().moe_input(x, y, weight, eps, router, n_used, renormalize)
        t, d = x.shape
        self.paths.ran("moe_input", "cuda")
        x_out, h = torch.empty_like(x), torch.empty_like(x)
        hq = torch.empty(t, d // 32 * Q8_WORDS, dtype=torch.int32, device=x.device)
        logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
        weights = torch.empty(t, n_used, dtype=torch.float32, device=x.device)
        experts = torch.empty(t, n_used, dtype=torch.int64, device=x.device)
        self._launch("moe_input_rows", (-(-e // ROUTER_WARPS), t), 32 * ROUTER_WARPS, x.data_ptr(), y.data_ptr(),
                     weight.data_ptr(), np.int32(d), np.float32(eps), router.data_ptr(), np.int32(e),
                     logits.data_ptr(), np.int32(n_used), np.int32(renormalize), weights.data_ptr(),
                     experts.data_ptr(), self.rows_done.data_ptr(), x_out.data_ptr(), h.data_ptr(), hq.data_ptr(),
                     shared_mem=4 * d)
        return x_out, h, weights, experts, hq

    def route(self, h: torch.Tensor, router: torch.Tensor, n_used: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        e, d = router.shape
        if h.shape[0] > MAX_ROUTED_ROWS:  # a prompt's rows: the GEMM is the right tool, not a fallback
            self.paths.ran("route", "gemm")
            return super().route(h, router, n_used, renormalize)
        if not (self._ok(h) and router.dtype == torch.float32 and router.is_contiguous() and e <= MAX_EXPERTS
                and n_used <= min(32, e) and d % 4 == 0 and router.data_ptr() % 16 == 0):
            self._twin("route", NOT_BF16 if not self._ok(h) else f"router {router.dtype} (contiguous fp32, 16-byte "
                       f"aligned, rows a multiple of 4 wide: {d}), {e} experts (<= {MAX_EXPERTS}) or {n_used} picks "
                       f"(<= 32)")
            return super().route(h, router, n_used, renormalize)
        self.paths.ran("route", "cuda")
        t = h.shape[0]
        logits = torch.empty(t, e, dtype=torch.float32, device=h.device)
        weights = torch.empty(t, n_used, dtype=torch.float32, device=h.device)
        experts = torch.empty(t, n_used, dtype=torch.int64, device=h.device)
        self._launch("route_rows", (-(-e // ROUTER_WARPS), t), 32 * ROUTER_WARPS, h.data_ptr(), router.data_ptr(),
                     np.int32(d), np.int32(e), logits.data_ptr(), np.int32(n_used), np.int32(renormalize),
                     weights.data_ptr(), experts.data_ptr(), self.rows_done.data_ptr())
        return weights, experts
