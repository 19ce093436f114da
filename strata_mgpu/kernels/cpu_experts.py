"""A layer's routed experts computed on the host's cores, read from their GGUF bytes in place.

Shape legend: T = token rows, D = hidden, F = expert width, E = experts a layer, A = picks a row.

Both executors take one layer's experts as the host arena lays them out (`stage.host.arena`:
expert after expert, each [gate | up | down] in its GGUF blocks) and return the weighted sum of
every row's picks, [T, D] fp32 (`routing.combine`'s product: the picks' outputs [T, A, D] times
their weights, summed in fp32).

- `GgmlExperts`: ggml's CPU kernels (ggml-python's low-level bindings). A call is a graph of three
  ops, `ggml_mul_mat_id` over gate and up at once ([D, 2F, E]: gate and up are adjacent rows of an
  expert), `ggml_swiglu` (silu of the first half times the second), `ggml_mul_mat_id` over down
  ([F, D, E]). The weight tensors are views: made in a context without data (no_alloc), their
  `data` set to the layer's first byte and their expert stride (`nb[2]`) to the arena's expert
  size, so nothing is copied or dequantized. Activations, ids and results are torch tensors whose
  addresses the graph's tensors take each call. ggml quantizes each matmul's input to the weight
  type's vec_dot type first (Q8_K for the K-quants and IQ types, Q8_0 for Q4_0, Q8_0, IQ4_NL and
  MXFP4, Q8_1 for Q4_1/Q5_x, fp16/bf16 for those float types): that rounding is all that separates
  it from the twin (tests/test_cpu_experts.py states the tolerance per type).
- `TorchExperts`: the twin, each picked expert dequantized (`quant.dequant`) and multiplied in fp32,
  one expert at a time. What a CPU stage runs where ggml-python is missing (`select_cpu_experts`
  says so once), and what the tests hold ggml to.

Both also multiply a CPU stage's dense projections from their blocks (`matmul`: x [T, K] times
W [N, K] of any served type -> [T, N] fp32), ggml through `ggml_mul_mat` over the bytes in place
(its input quantized as above), the twin by dequantizing W each call: a stage's projections then
read 1.06 bytes a weight (Q8_0) rather than the 4 of fp32 copies, and take that much less RAM.

Each executor keeps an `ExpertRate` (calls, expert bytes read, seconds) for each number of rows
its calls had (`rates`; `rate`: all of them): the measurement a caller splitting a layer's picks
between the cores and a link reads (`bench` reports the batch-1 decode's and the prompts').
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType

from strata_mgpu.kernels.paths import warn_once
from strata_mgpu.kernels.run_queue import ThreadPace
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.quant.dequant import dequantize_rows

log = logging.getLogger("strata.kernels")
Q = GGMLQuantizationType
ROWS_A_GRAPH = 256  # rows computed by one graph: bounds the intermediates ([T, A, 2F + F + D] fp32, 22 MB of 30B-A3B)
GRAPHS_KEPT = 32  # expert graphs kept built, by (layout, rows), the least recently used dropped first
# projection graphs kept built, by (type, K, N, rows below DEQUANT_ROWS): a serving CPU stage meets every
# decode batch size and short prompt length, and rebuilding a layer's few graphs each step would cost more
# than the step's Python (their work buffers hold one quantized input: small below DEQUANT_ROWS rows)
MATMUL_GRAPHS_KEPT = 512  # a Q4_K_M file: 5 shapes (q, k, v of two types, o, head) x 63 row counts
# `matmul` from this many rows on: W dequantized by ggml (`to_float`, into a kept fp32 buffer), then
# torch's GEMM, which outruns ggml_mul_mat's quantized dots at a prompt's rows (docs/BENCHMARKS.md);
# W of at most DEQUANT_MAX_VALUES (the projections; a prompt's head takes only its last rows)
DEQUANT_ROWS = 64
DEQUANT_MAX_VALUES = 64 << 20


@dataclass
class ExpertRate:
    """What an executor's calls read and how long they took (wall time of the whole call)."""

    calls: int = 0
    expert_bytes: int = 0  # each call's distinct picked experts' bytes: what the cores read from RAM
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float | None:
        return self.expert_bytes / self.seconds / 1e9 if self.seconds > 0 else None

    @property
    def ms_per_call(self) -> float | None:
        return 1e3 * self.seconds / self.calls if self.calls else None

    def __add__(self, other: ExpertRate) -> ExpertRate:
        return ExpertRate(self.calls + other.calls, self.expert_bytes + other.expert_bytes,
                          self.seconds + other.seconds)


class RateCounter:
    """An executor's rates, one a row count: rows -> ExpertRate."""

    def __init__(self) -> None:
        self.rates: dict[int, ExpertRate] = {}

    def count(self, rows: int, expert_bytes: int, seconds: float) -> None:
        rate = self.rates.setdefault(rows, ExpertRate())
        rate.calls += 1
        rate.expert_bytes += expert_bytes
        rate.seconds += seconds

    @property
    def rate(self) -> ExpertRate:
        """Every call's, whatever its rows."""
        return sum(self.rates.values(), ExpertRate())

    def reset_rates(self) -> None:
        self.rates.clear()


class CpuExperts(Protocol):
    """What computes a layer's routed experts on the host's cores (`GgmlExperts`, `TorchExperts`):
    a stage's `HostCoreExperts` calls it a layer at a time; a caller sharing picks with a link
    reads its rates."""

    name: str  # what the stage's kernel set counts its calls under ("cpu_experts:NAME")
    threads: int  # the cores it computes on (0: torch's own)
    rates: dict[int, ExpertRate]  # rows a call -> what those calls read and took

    @property
    def rate(self) -> ExpertRate: ...

    def reset_rates(self) -> None: ...

    def describe(self) -> str: ...

    def close(self) -> None:
        """Free what it holds (ggml's graphs and pool); no call may come after."""
        ...

    def moe(self, layer: torch.Tensor, lay: ExpertLayout, h: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor) -> torch.Tensor:
        """Layer bytes uint8 [E * expert_bytes] (the arena's layout), rows h [T, D], weights [T, A]
        and experts [T, A] -> the weighted sum of each row's picks [T, D] fp32."""
        ...

    def matmul(self, x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, k: int) -> torch.Tensor:
        """x [T, K] times W.T, W [N, K] given as its blocks raw [N, row_bytes] uint8 of ggml_type
        -> [T, N] fp32 (not counted in the rates: those are the experts')."""
        ...


class TorchExperts(RateCounter):
    """The twin: each distinct picked expert dequantized from the layer's bytes and multiplied in fp32."""

    name = "torch"
    threads = 0  # torch's own

    def describe(self) -> str:
        return "torch twin (dequantize + matmul)"

    def close(self) -> None:
        """Nothing held."""

    def moe(self, layer: torch.Tensor, lay: ExpertLayout, h: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor) -> torch.Tensor:
        """Layer bytes uint8 [E * expert_bytes] (the arena's layout), rows h [T, D], weights [T, A]
        and experts [T, A] -> the weighted sum of each row's picks [T, D] fp32."""
        t0 = time.perf_counter()
        n_experts = layer.numel() // lay.expert_bytes
        assert layer.numel() == n_experts * lay.expert_bytes and layer.dtype == torch.uint8
        n_picked = distinct(experts, n_experts)
        y = self._picks(layer.view(n_experts, lay.expert_bytes), lay, h.float(), experts)  # [T, A, D]
        out = combine_picks(y, weights)
        self.count(experts.shape[0], n_picked * lay.expert_bytes, time.perf_counter() - t0)
        return out

    def matmul(self, x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, k: int) -> torch.Tensor:
        """As `CpuExperts.matmul`: W dequantized in fp32, then x @ W.T."""
        return x.float() @ dequantize_rows(raw, ggml_type, k).T

    @staticmethod
    def _picks(experts_bytes: torch.Tensor, lay: ExpertLayout, h: torch.Tensor, experts: torch.Tensor
               ) -> torch.Tensor:
        t, a = experts.shape
        d = h.shape[1]
        f = lay.gate_weights // d
        y = torch.empty(t, a, d, dtype=torch.float32)
        for e in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == e)
            src = experts_bytes[e]
            gu = dequantize_rows(src[:2 * lay.gate_bytes].reshape(2 * f, -1), lay.gate_type, d)  # [2F, D]
            wd = dequantize_rows(src[lay.down_offset:lay.down_offset + lay.down_bytes].reshape(d, -1),
                                 lay.down_type, f)  # [D, F]
            g = h[rows] @ gu.T  # [n, 2F]
            y[rows, slot] = (F.silu(g[:, :f]) * g[:, f:]) @ wd.T
        return y


def combine_picks(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The picks' outputs y [T, A, D] weighted by weights [T, A] and summed: [T, D] fp32 (a [1, A] x
    [A, D] product a row, as `routing.combine`)."""
    return torch.bmm(weights.float().unsqueeze(1), y).squeeze(1)


def distinct(experts: torch.Tensor, n_experts: int) -> int:
    """How many distinct experts experts [T, A] picks; a ValueError for a pick outside 0..n_experts-1
    (ggml would read past the layer). A decode step's few picks on the host (a list is cheaper than
    three tensor ops there), a prompt's by a count."""
    flat = experts.reshape(-1)
    if flat.numel() <= 256:
        picked = flat.tolist()
        lo, hi, n = min(picked), max(picked), len(set(picked))
    else:
        lo, hi = (int(v) for v in torch.aminmax(flat))
        n = int((torch.bincount(flat, minlength=n_experts) > 0).sum()) if lo >= 0 and hi < n_experts else 0
    if lo < 0 or hi >= n_experts:
        raise ValueError(f"a pick outside the layer's {n_experts} experts: {lo if lo < 0 else hi}")
    return n


class _Graph:
    """A ggml graph built once, in a context of its own holding metadata only (no tensor has data
    of its own: each call sets their addresses), planned on the executor's thread pool with the
    plan's work buffer (the inputs quantized to the weights' dot type, row maps)."""

    N_TENSORS, N_NODES = 16, 8

    def __init__(self, ggml: Any):
        self.ggml = ggml
        params = ggml.ggml_init_params(mem_size=self.N_TENSORS * ggml.ggml_tensor_overhead()
                                       + ggml.ggml_graph_overhead_custom(self.N_NODES, False) + 4096,
                                       mem_buffer=None, no_alloc=True)
        self.ctx = ggml.ggml_init(params)
        assert self.ctx is not None, "ggml_init failed"

    def _plan(self, out: Any, threads: int, pool: Any) -> None:
        """The graph that computes `out`, and its plan."""
        ggml = self.ggml
        self.graph = ggml.ggml_new_graph_custom(self.ctx, self.N_NODES, False)
        ggml.ggml_build_forward_expand(self.graph, out)
        # planned for the pool's every thread: the work buffer then fits any fewer (ggml adds a cache line a
        # thread to the largest op's need, which for mul_mat(_id) and swiglu does not depend on the threads)
        self.plan = ggml.ggml_graph_plan(self.graph, threads, pool)
        self.planned_threads = int(self.plan.n_threads)
        self.work = np.empty(max(int(self.plan.work_size), 1), dtype=np.uint8)
        self.plan.work_data = self.work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        self.plan_ref = ctypes.byref(self.plan)

    def _compute(self, threads: int) -> None:
        """On the pool's first `threads` threads (1..the planned count; the others stay asleep)."""
        self.plan.n_threads = min(threads, self.planned_threads)
        status = self.ggml.ggml_graph_compute(self.graph, self.plan_ref)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def free(self) -> None:
        if self.ctx is not None:
            self.ggml.ggml_free(self.ctx)
            self.ctx = None


class _MoeGraph(_Graph):
    """One layout's graph for `rows` rows: gate and up at once, swiglu, down, over the picks."""

    def __init__(self, ggml: Any, lay: ExpertLayout, d: int, n_experts: int, n_used: int, rows: int, threads: int,
                 pool: Any):
        super().__init__(ggml)
        f = lay.gate_weights // d
        self.w_gate_up = ggml.ggml_new_tensor_3d(self.ctx, int(lay.gate_type), d, 2 * f, n_experts)  # [D, 2F, E]
        self.w_down = ggml.ggml_new_tensor_3d(self.ctx, int(lay.down_type), f, d, n_experts)  # [F, D, E]
        for w in (self.w_gate_up, self.w_down):  # experts lie expert_bytes apart in the arena
            assert w.contents.nb[1] * w.contents.ne[1] <= lay.expert_bytes
            w.contents.nb[2] = lay.expert_bytes
            w.contents.nb[3] = lay.expert_bytes * n_experts
        assert self.w_gate_up.contents.nb[1] * 2 * f == 2 * lay.gate_bytes, "gate rows are whole blocks"
        self.x = ggml.ggml_new_tensor_3d(self.ctx, ggml.GGML_TYPE_F32, d, 1, rows)  # [D, 1, T]: one row for all picks
        self.ids = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_I32, n_used, rows)  # [A, T]
        self.gate_up = ggml.ggml_mul_mat_id(self.ctx, self.w_gate_up, self.x, self.ids)  # [2F, A, T]
        self.act = ggml.ggml_swiglu(self.ctx, self.gate_up)  # [F, A, T]: silu(gate) * up
        self.y = ggml.ggml_mul_mat_id(self.ctx, self.w_down, self.act, self.ids)  # [D, A, T]
        self._plan(self.y, threads, pool)
        self.shapes = {"y": (rows, n_used, d)}
        self.act_offset = rows * n_used * 2 * f  # floats: act follows gate_up in one scratch buffer
        self.intermediates = rows * n_used * 3 * f
        self.down_offset = lay.down_offset
        # the tensors whose `data` each call sets (a `contents` read makes a new ctypes object: kept once)
        self.structs = [t.contents for t in (self.w_gate_up, self.w_down, self.x, self.ids, self.gate_up, self.act,
                                             self.y)]

    def run(self, layer: torch.Tensor, h: torch.Tensor, ids: torch.Tensor, threads: int) -> torch.Tensor:
        """layer uint8 [E * expert_bytes], h [T, D] fp32 and ids [T, A] int32, both contiguous ->
        the picks' outputs [T, A, D] fp32, on `threads` of the pool's. The intermediates are torch's,
        freed on return."""
        y = torch.empty(self.shapes["y"], dtype=torch.float32)  # returned
        work = torch.empty(self.intermediates, dtype=torch.float32)  # gate_up [T, A, 2F], then act [T, A, F]
        base, scratch = layer.data_ptr(), work.data_ptr()
        w_gate_up, w_down, x, ids_, gate_up, act, out = self.structs
        w_gate_up.data, w_down.data, x.data, ids_.data = base, base + self.down_offset, h.data_ptr(), ids.data_ptr()
        gate_up.data, act.data, out.data = scratch, scratch + 4 * self.act_offset, y.data_ptr()
        self._compute(threads)
        return y


class _MatmulGraph(_Graph):
    """x [T, K] f32 times W [N, K] of one type (`ggml_mul_mat`): ggml's W is [K, N] (ne0 = K), its
    product [N, T], which is x @ W.T [T, N] row-major. Built once per (type, K, N, T)."""

    N_TENSORS, N_NODES = 4, 4

    def __init__(self, ggml: Any, ggml_type: int, k: int, n: int, rows: int, threads: int, pool: Any):
        super().__init__(ggml)
        w = ggml.ggml_new_tensor_2d(self.ctx, ggml_type, k, n)  # [K, N]
        x = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_F32, k, rows)  # [K, T]
        y = ggml.ggml_mul_mat(self.ctx, w, x)  # [N, T]
        self._plan(y, threads, pool)
        self.row_bytes = int(w.contents.nb[1])
        self.shape = (rows, n)
        self.structs = [t.contents for t in (w, x, y)]

    def run(self, raw: torch.Tensor, x: torch.Tensor, threads: int) -> torch.Tensor:
        """raw [N, row_bytes] uint8 and x [T, K] f32, both contiguous -> [T, N] f32, on `threads`."""
        y = torch.empty(self.shape, dtype=torch.float32)
        w_, x_, y_ = self.structs
        w_.data, x_.data, y_.data = raw.data_ptr(), x.data_ptr(), y.data_ptr()
        self._compute(threads)
        return y


class GgmlExperts(RateCounter):
    """ggml's CPU kernels over the experts' bytes in place, on a thread pool of `threads` (see the
    module docstring). One call at a time (a lock): ctypes lets go of the GIL while ggml computes,
    so another thread may run Python meanwhile, but not a second graph on the same pool. With a
    `pace` (`run_queue.ThreadPace`, its ceiling `threads`) each call computes on the pace's count
    of the pool's threads, the graphs planned once for all of them, and tells the pace how long it
    took; without, on all of them."""

    name = "ggml"

    def __init__(self, threads: int, poll: int = 0, pace: ThreadPace | None = None):
        import ggml  # ggml-python: the optional extra `cpu-experts` (select_cpu_experts checks it is there)

        assert threads >= 1 and 0 <= poll <= 100
        assert pace is None or pace.policy.ceiling == threads
        super().__init__()
        self.ggml = ggml
        self.threads, self.poll = threads, poll
        params = ggml.ggml_threadpool_params_default(threads)
        # 0: idle workers sleep at once rather than spin (a CPU stage: torch's ops run on the same cores
        # between calls); more: they spin that long (ggml's polling level, 0-100) before sleeping, so calls
        # that come every ~0.1 ms (a GPU stage's hand-over, a layer apart) find them awake
        params.poll = poll
        self._pool = ggml.ggml_threadpool_new(ctypes.byref(params))  # its threads - 1 workers, the caller the first
        assert self._pool, "ggml_threadpool_new failed"
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # the experts'
        self._matmuls: OrderedDict[tuple, _Graph] = OrderedDict()  # the projections'
        self._dequant_buffer = torch.empty(0, dtype=torch.float32)  # `_dequantized`'s, grown as needed
        self._lock = threading.Lock()
        self.pace = pace
        self._free = weakref.finalize(self, _free, ggml, [self._graphs, self._matmuls], self._pool, pace)  # at exit too

    def describe(self) -> str:
        pace = f" ({self.pace.describe()})" if self.pace is not None and self.pace.adaptive else ""
        return (f"ggml on {self.threads} thread{'s' if self.threads > 1 else ''}{pace}"
                + (f", polling {self.poll}" if self.poll else ""))

    @property
    def threads_now(self) -> int:
        """The threads the last call computed on (the pace's; `threads` without one)."""
        return self.pace.threads if self.pace is not None else self.threads

    def _threads(self) -> int:
        return self.pace.threads_now() if self.pace is not None else self.threads

    def moe(self, layer: torch.Tensor, lay: ExpertLayout, h: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor) -> torch.Tensor:
        """As `TorchExperts.moe`: layer bytes uint8 [E * expert_bytes], h [T, D], weights [T, A],
        experts [T, A] -> [T, D] fp32. Rows go through graphs of at most ROWS_A_GRAPH rows."""
        t0 = time.perf_counter()
        n_experts = layer.numel() // lay.expert_bytes
        t, a = experts.shape
        d = h.shape[1]
        assert self._free.alive, "the executor was closed"
        # ggml aborts the process on a bad shape or id: check here, where it can be raised
        assert layer.dtype == torch.uint8 and layer.is_contiguous() and layer.numel() == n_experts * lay.expert_bytes
        assert lay.gate_weights % d == 0 and h.shape[0] == t and weights.shape == (t, a)
        n_picked = distinct(experts, n_experts)
        ids = experts.to(torch.int32).contiguous()
        x = h if h.dtype == torch.float32 and h.is_contiguous() else h.float().contiguous()
        with self._lock:
            k = self._threads()
            ys = [self._graph(lay, d, n_experts, a, min(t, start + ROWS_A_GRAPH) - start).run(
                layer, x[start:start + ROWS_A_GRAPH], ids[start:start + ROWS_A_GRAPH], k)
                for start in range(0, t, ROWS_A_GRAPH)]  # [rows, A, D] each
            if self.pace is not None:
                self.pace.call_done((0, lay.expert_bytes, t), time.perf_counter() - t0)
        out = combine_picks(ys[0] if len(ys) == 1 else torch.cat(ys), weights)
        self.count(t, n_picked * lay.expert_bytes, time.perf_counter() - t0)
        return out

    def matmul(self, x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLQuantizationType, k: int) -> torch.Tensor:
        """As `CpuExperts.matmul`, through `ggml_mul_mat` over raw's blocks in place."""
        t, n = x.shape[0], raw.shape[0]
        assert self._free.alive, "the executor was closed"
        assert x.shape[1] == k and raw.dtype == torch.uint8 and raw.is_contiguous(), "x [T, K], raw [N, row_bytes]"
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        key = ("matmul", int(ggml_type), k, n, t)
        t0 = time.perf_counter()
        with self._lock:
            if t >= DEQUANT_ROWS and n * k <= DEQUANT_MAX_VALUES:
                return xf @ self._dequantized(raw, ggml_type, k).T
            graph = self._matmuls.get(key)
            if graph is None:
                graph = _keep(self._matmuls, key, MATMUL_GRAPHS_KEPT,
                              _MatmulGraph(self.ggml, int(ggml_type), k, n, t, self.threads, self._pool))
            assert isinstance(graph, _MatmulGraph)
            # ggml reads raw.shape[1] bytes a row: a mismatch would read past the matrix
            assert raw.shape[1] == graph.row_bytes, f"{ggml_type.name} rows of {k} values take {graph.row_bytes} bytes"
            self._matmuls.move_to_end(key)
            y = graph.run(raw, xf, self._threads())
            if self.pace is not None:
                self.pace.call_done((int(ggml_type), k, n, t), time.perf_counter() - t0)
            return y

    def _dequantized(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, k: int) -> torch.Tensor:
        """W [N, K] fp32 from raw's blocks by ggml's own dequantization, in a buffer kept for the
        next call (valid until then)."""
        values = raw.shape[0] * k
        if ggml_type == Q.F32:  # its own values (ggml has no conversion for it)
            assert raw.shape[1] == 4 * k, f"F32 rows of {k} values take {4 * k} bytes"
            return raw.view(torch.float32)
        if self._dequant_buffer.numel() < values:
            self._dequant_buffer = torch.empty(values, dtype=torch.float32)
        out = self._dequant_buffer[:values]
        traits = self.ggml.ggml_get_type_traits(int(ggml_type)).contents
        assert traits.type_size * (k // traits.blck_size) == raw.shape[1], \
            f"{ggml_type.name} rows of {k} values take {traits.type_size * (k // traits.blck_size)} bytes"
        traits.to_float(ctypes.c_void_p(raw.data_ptr()), ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_float)),
                        values)
        return out.view(raw.shape[0], k)

    def _graph(self, lay: ExpertLayout, d: int, n_experts: int, n_used: int, rows: int) -> _MoeGraph:
        # plain ints: a frozen dataclass hashes its fields anew at every lookup (microseconds a layer call)
        key = (int(lay.gate_type), int(lay.down_type), lay.gate_bytes, lay.down_bytes, d, n_experts, n_used, rows)
        graph = self._graphs.get(key)
        if graph is None:
            graph = _keep(self._graphs, key, GRAPHS_KEPT,
                          _MoeGraph(self.ggml, lay, d, n_experts, n_used, rows, self.threads, self._pool))
        assert isinstance(graph, _MoeGraph)
        self._graphs.move_to_end(key)
        return graph


    def close(self) -> None:
        """Free the graphs and the thread pool (also done when the executor is collected)."""
        self._free()


def _keep(graphs: OrderedDict[tuple, _Graph], key: tuple, most: int, graph: _Graph) -> _Graph:
    """A new graph kept, the least recently used one freed past `most`."""
    graphs[key] = graph
    if len(graphs) > most:
        graphs.popitem(last=False)[1].free()
    return graph


def _free(ggml: Any, kept: list[OrderedDict[tuple, _Graph]], pool: Any, pace: ThreadPace | None) -> None:
    for graphs in kept:
        for graph in graphs.values():
            graph.free()
        graphs.clear()
    if pool is not None:
        ggml.ggml_threadpool_free(pool)
    if pace is not None:
        pace.close()


def ggml_missing() -> str | None:
    """Why ggml-python cannot be used here (None: it can)."""
    try:
        import ggml  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: the package is there, its shared libraries not
        return f"ggml-python is not installed ({type(e).__name__}: {e}); pip install 'strata-mgpu[cpu-experts]'"
    return None


def select_cpu_experts(threads: int, adaptive: bool = True) -> CpuExperts:
    """The executor a CPU stage computes its experts with, chosen once: ggml on at most `threads`
    threads, torch's intra-op threads following them (`run_queue.ThreadPace`: fewer while other
    processes take the cores, where `adaptive`), else (ggml-python missing) the torch twin, with one
    warning a process saying so."""
    reason = ggml_missing()
    if reason is not None:
        warn_once("a CPU stage computes its experts with the torch twin (each picked expert dequantized every call: "
                  "slower)", reason)
        return TorchExperts()
    return GgmlExperts(threads, pace=ThreadPace(threads, adaptive, torch_threads=True))


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads counted once): the (package, core)
    pairs of the CPUs in its affinity mask, from /sys; the CPU count where /sys does not say."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset's, a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def clamp_threads(threads: int, cpus: int | None = None) -> tuple[int, str | None]:
    """`--threads` cut to the CPUs the process may use, and the warning saying so (None if it fits).
    ggml's workers spin while they wait for each other: with more of them than CPUs they take
    turns, and every graph waits for the one that lost its CPU."""
    cpus = usable_cpus() if cpus is None else cpus
    if threads <= cpus:
        return threads, None
    return cpus, (f"--threads {threads} is more than the {cpus} CPU{'s' if cpus > 1 else ''} this process may use "
                  f"(its affinity): using {cpus}; more threads than CPUs make ggml's workers take turns")


def default_threads(gpu_stages: int, cores: int | None = None) -> int:
    """`--threads` when not given: the physical cores less one for each GPU stage's host thread
    (the thread that queues the stage's work) and, beside GPU stages, one for the process's other
    threads (the server's, CUDA's), at least one: a GPU stage's decode hand-over keeps ggml's pool
    spinning, and a pool thread that loses its core stalls every request. On a CPU-only run all of them."""
    cores = physical_cores() if cores is None else cores
    return max(1, cores - gpu_stages - (1 if gpu_stages else 0))
