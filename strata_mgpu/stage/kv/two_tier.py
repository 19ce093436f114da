"""KV in two tiers: a sequence's last `window` cells in VRAM, its older prefix in host RAM (pinned
on CUDA), assembled layer by layer in a staging buffer on the device for attention.

Shape legend: L = layers of the stage, W = window cells, C = host rows allocated, S = staging
cells (the longest sequence), Hkv = KV heads, Dh = head dim, R = a head's stored row (Dh, or
Dh / 32 * 34 bytes of Q8_0 blocks: `KVFormat`, as ring, host rows and staging all store them).

Where cell p lives (per layer i, `host_rows[i]` = h): positions [0, h) in host rows [0, h);
positions [h, length) in the VRAM ring at slot p % W. Before the first spill every position sits
in its own slot, so the ring reads like a plain `KVCache` (and the decode step can be captured);
after it, attention reads from a staging buffer: host rows, then the ring's cells, then the new
rows. Host rows are per layer, so a forward that fails between layers leaves every layer
readable: a retry gives the same result.

Streams (prefetch on): uploads into staging and spills out of it run on the side stream, which
waits for `released[b]` (recorded on the compute stream when side work on buffer b is queued);
the compute stream waits for `ready[b]` (recorded after the side stream's last use of b) before
it reads or overwrites b, and an upload on the compute stream also for the last spill
(`_spilled`). Every stream operation and buffer use goes through the stage's `DeviceContext`,
so the ordering twin (`stage/streams.py`) raises `OrderingError` on a missing wait.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.kv_cache import PLAIN_KV, KVCache, KVFormat, kv_cell_bytes
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.host.pool import HostBufferPool

_owner_ids = itertools.count(1)


@dataclass(frozen=True)
class Hold:
    """A staging buffer holds (or is being filled with) `rows` host rows of `owner`'s `layer`."""

    owner: int
    layer: int
    rows: int


class KVStaging:
    """Device buffers where a spilled sequence's keys and values of one layer are put in position
    order for attention: per buffer, keys and values [S, Hkv, R] as `format` stores them, views of
    one allocation each (so the ordering twin tells the buffers apart). One per stage, shared by its
    two-tier caches. With prefetch, two buffers and a side stream: layer i + 1's host prefix uploads
    into one while layer i attends from the other."""

    def __init__(self, n_kv_heads: int, head_dim: int, max_cells: int, *, ctx: DeviceContext,
                 dtype: torch.dtype, prefetch: bool,
                 kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV):
        self.ctx, self.device, self.prefetch = ctx, ctx.device, prefetch
        self.format = KVFormat(dtype, *kv_types)
        self.max_cells, self._heads, self._head_dim = max_cells, n_kv_heads, head_dim
        n = 2 if prefetch else 1
        size = cells_nbytes(self.format, max_cells, n_kv_heads, head_dim)
        self.buffers = [ctx.label(torch.zeros(size, device=ctx.device, dtype=torch.uint8), f"kv staging {b}")
                        for b in range(n)]  # S cells' keys, then their values, in bytes
        self.side = ctx.new_stream("kv side") if prefetch else None  # None on the plain CPU too
        self.ready = [ctx.event(f"kv staging {b} ready") if prefetch else None for b in range(n)]
        self.released = [ctx.event(f"kv staging {b} released") if prefetch else None for b in range(n)]
        self.holds: list[Hold | None] = [None] * n  # per buffer: a prefetch not yet consumed
        self.pool = HostBufferPool(pin=ctx.is_cuda)  # the caches' host rows, reused from one sequence to the next

    @classmethod
    def for_model(cls, spec: ModelSpec, max_cells: int, *, ctx: DeviceContext, dtype: torch.dtype,
                  prefetch: bool, kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV
                  ) -> KVStaging:
        return cls(spec.n_kv_heads, spec.head_dim, max_cells, ctx=ctx, dtype=dtype, prefetch=prefetch,
                   kv_types=kv_types)

    def kv(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer b's keys and values, [S, Hkv, R] each (views of its bytes)."""
        return split_cells(self.buffers[b], self.format, self.max_cells, self._heads, self._head_dim)

    @property
    def n_buffers(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.buffers)

    def buffer_for(self, layer: int) -> int:
        return layer % self.n_buffers

    @contextlib.contextmanager
    def on_side(self, b: int) -> Iterator[None]:
        """Queue the enclosed copies touching buffer b on the side stream, after every use of b queued so
        far on the current stream; later users wait on `ready[b]`."""
        if not self.prefetch:
            yield
            return
        ctx = self.ctx
        ctx.record(self.released[b])  # on the current stream, after its uses of b so far
        ctx.wait(self.released[b], self.side)
        with ctx.use(self.side):
            yield
        ctx.record(self.ready[b], self.side)

    def wait_side(self, b: int) -> None:
        self.ctx.wait(self.ready[b])

    def take(self, owner: int, layer: int, rows: int, b: int) -> bool:
        """Whether buffer b holds `owner`'s prefetched rows of `layer`. A hold of anything else is dropped:
        the caller is about to overwrite b."""
        hold = self.holds[b]
        self.holds[b] = None
        self.wait_side(b)
        return hold == Hold(owner, layer, rows)

    def drain(self, owner: int | None = None) -> None:
        """Wait (host) for the side stream; forget `owner`'s holds (every hold when None)."""
        if self.prefetch:  # not self.side: None is also the plain CPU's, and synchronize(None) the current stream
            self.ctx.synchronize(self.side)
        self.holds = [None if h is None or owner is None or h.owner == owner else h for h in self.holds]


def _drain_before_free(staging: KVStaging, owner: int) -> None:
    staging.drain(owner)
    staging.ctx.synchronize_device()  # spills queued on the caller's stream (prefetch off), whichever it was


def _release_host(staging: KVStaging, owner: int, buffers: list[torch.Tensor]) -> None:
    _drain_before_free(staging, owner)
    while buffers:
        staging.pool.give(buffers.pop())


class TwoTierKV:
    """One sequence's KV for `n_layers` layers (see the module docstring). `KVCache`'s interface plus
    `prefetch(layer)` (called one layer ahead) and `drain()` (called when a forward fails).

    `k`, `v` [L, W', Hkv, Dh] are the VRAM ring (W' grows by doubling up to W; given whole, the KV pool's
    cells, as a sequence longer than the pool holds it).
    """

    block_table: torch.Tensor | None = None  # ring slot p holds position p until the first spill
    block_tokens = 0

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, window: int, max_length: int,
                 staging: KVStaging, capacity: int = 256, dtype: torch.dtype = torch.float32,
                 kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV,
                 ring: tuple[torch.Tensor, torch.Tensor] | None = None):
        if not 0 < window < max_length:
            raise ValueError(f"a two-tier cache needs 0 < window ({window}) < max_length ({max_length})")
        if staging.max_cells < max_length:
            raise ValueError(f"the staging buffer holds {staging.max_cells} cells, the sequence may reach "
                             f"{max_length}")
        self.format = KVFormat(dtype, *kv_types)
        assert staging.format == self.format, "staging and cache formats differ"
        self.window, self.max_length, self.length = window, max_length, 0
        self.staging, self.ctx = staging, staging.ctx
        self.device = staging.device
        self.owner = next(_owner_ids)
        # Declared per layer: a layer's spill and another layer's upload touch disjoint rows.
        self._host_rows_name = [f"{self.ctx.name} kv {self.owner} host rows of layer {i}" for i in range(n_layers)]
        if ring is not None:  # the KV pool's cells, every block of it: the ring at its full window
            assert ring[0].shape[:2] == (n_layers, window) and ring[1].shape[:2] == (n_layers, window)
            self.k, self.v = ring
        else:
            cap = min(capacity, window)
            self.k = self.format.zeros(self.format.keys, n_layers, cap, n_kv_heads, head_dim, device=self.device)
            self.v = self.format.zeros(self.format.values, n_layers, cap, n_kv_heads, head_dim, device=self.device)
        self._heads, self._head_dim = n_kv_heads, head_dim
        self.host_rows = [0] * n_layers  # per layer: positions [0, h) are on the host
        self.host_k: torch.Tensor | None = None  # [L, C, Hkv, R], allocated at the first spill
        self.host_v: torch.Tensor | None = None
        self._host_buffers: list[torch.Tensor] = []  # the pool's buffer host_k and host_v view (0 or 1)
        # This cache's last spill on the side stream: an upload on the compute stream waits for it.
        self._spilled = self.ctx.event(f"kv {self.owner} spilled") if staging.prefetch else None
        self._finalizer: weakref.finalize | None = None
        self.closed = False

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """VRAM of the ring (the shared staging is counted once per stage)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def host_nbytes(self) -> int:
        host_k, host_v = self.host_k, self.host_v
        return 0 if host_k is None or host_v is None else sum(x.numel() * x.element_size() for x in (host_k, host_v))

    @property
    def spilled(self) -> bool:
        return any(self.host_rows)

    @property
    def graph_capturable(self) -> bool:
        """Every cell, the next one's included, sits in VRAM at its own position."""
        return not self.spilled and self.length < self.window

    @property
    def offset_writes(self) -> bool:
        return False

    # -- the KVCache interface -----------------------------------------------------------------
    def reserve(self, new_tokens: int) -> None:
        if self.closed:
            raise RuntimeError("this KV cache was closed")
        need = self.length + new_tokens
        if need > self.max_length:
            raise ValueError(f"sequence of {need} tokens exceeds the context of {self.max_length}")
        if need > self.capacity and self.capacity < self.window:  # never spilled: cell p sits in slot p
            cap = min(self.window, max(need, 2 * self.capacity))
            k = self.k.new_zeros(self.n_layers, cap, *self.k.shape[2:])
            v = self.v.new_zeros(self.n_layers, cap, *self.v.shape[2:])
            k[:, :self.length] = self.k[:, :self.length]
            v[:, :self.length] = self.v[:, :self.length]
            self.k, self.v = k, v
        # A layer's host prefix after this forward: max(h, need - window), h within what is there.
        if need - self.window > (0 if self.host_k is None else self.host_k.shape[1]):
            self._grow_host(need - self.window)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, at: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [T, Hkv, Dh] keys/values after the cached ones; return all of them [length+T, Hkv, Dh]:
        views of the ring before the first spill, of a staging buffer after it (valid until this
        layer's attention has been queued)."""
        assert at == 0, "a two-tier cache writes a forward's rows at once"
        f = self.format
        start, end = self.length, self.length + k_new.shape[0]
        k_new, v_new = f.store(f.keys, k_new), f.store(f.values, v_new)  # [T, Hkv, R]: as the cells are stored
        h = min(self.host_rows[layer], start)  # host rows past `length` are a failed forward's: rewritten
        if h == 0 and end <= self.capacity:
            self.k[layer, start:end] = k_new
            self.v[layer, start:end] = v_new
            self.host_rows[layer] = 0  # a failed forward may have spilled rows that are not the sequence's
            return f.load(f.keys, self.k[layer, :end]), f.load(f.values, self.v[layer, :end])
        assert self.capacity == self.window, "reserve() before writing"
        st, ctx = self.staging, self.ctx
        b = st.buffer_for(layer)
        k_buf, v_buf = st.kv(b)  # [S, Hkv, R]
        prefetched = st.take(self.owner, layer, h, b)  # (this stream now waits for the side stream's use of b)
        ctx.access(st.buffers[b], "w")  # the host rows unless prefetched, the ring's cells, the new rows
        if not prefetched and h > 0:  # upload it on this stream
            ctx.wait(self._spilled)
            ctx.access(self._host_rows_name[layer], "r")
            self._upload(layer, h, k_buf, v_buf)
        for ring, pos in self._ring_spans(h, start):
            k_buf[pos] = self.k[layer, ring]
            v_buf[pos] = self.v[layer, ring]
        k_buf[start:end] = k_new
        v_buf[start:end] = v_new
        new_h = max(h, end - self.window)
        if new_h > h:  # the oldest cells leave the window, in position order
            with st.on_side(b):
                ctx.access(st.buffers[b], "r")
                ctx.access(self._host_rows_name[layer], "w")
                host_k, host_v = self._host_rows()
                host_k[layer, h:new_h].copy_(k_buf[h:new_h], non_blocking=True)
                host_v[layer, h:new_h].copy_(v_buf[h:new_h], non_blocking=True)
                ctx.record(self._spilled, st.side)
        for ring, pos in self._ring_spans(max(start, new_h), end):
            rows = slice(pos.start - start, pos.stop - start)
            self.k[layer, ring] = k_new[rows]
            self.v[layer, ring] = v_new[rows]
        self.host_rows[layer] = new_h
        ctx.access(st.buffers[b], "r")  # attention reads them next, on this stream
        return f.load(f.keys, k_buf[:end]), f.load(f.values, v_buf[:end])

    def advance(self, n: int) -> None:
        self.length += n

    # -- prefetch, drain, teardown -------------------------------------------------------------
    def prefetch(self, layer: int) -> None:
        """Start uploading `layer`'s host prefix into its staging buffer on the side stream. A no-op
        without prefetch, with nothing on the host, or while another sequence's prefetch holds that buffer."""
        st = self.staging
        if not st.prefetch or layer >= self.n_layers:
            return
        h = min(self.host_rows[layer], self.length)
        b = st.buffer_for(layer)
        if h == 0 or st.holds[b] is not None:
            return
        with st.on_side(b):  # this cache's spills were queued on the side stream before: in order
            self.ctx.access(self._host_rows_name[layer], "r")
            self.ctx.access(st.buffers[b], "w")
            self._upload(layer, h, *st.kv(b))
        st.holds[b] = Hold(self.owner, layer, h)

    def drain(self) -> None:
        """Wait for the side stream and drop this cache's pending prefetches; the cache stays consistent."""
        self.staging.drain(self.owner)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        else:
            self.staging.drain(self.owner)
        self.k = self.k.new_zeros(self.n_layers, 0, *self.k.shape[2:])
        self.v = self.v.new_zeros(self.n_layers, 0, *self.v.shape[2:])
        self.host_k = self.host_v = None
        self.closed = True

    # -- internals -----------------------------------------------------------------------------
    def _host_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host keys and values [L, C, Hkv, R]; there once `reserve` made room for a spill."""
        assert self.host_k is not None and self.host_v is not None, "reserve() makes the host rows before a spill"
        return self.host_k, self.host_v

    def _upload(self, layer: int, rows: int, k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        host_k, host_v = self._host_rows()
        k_buf[:rows].copy_(host_k[layer, :rows], non_blocking=True)
        v_buf[:rows].copy_(host_v[layer, :rows], non_blocking=True)

    def _ring_spans(self, start: int, stop: int) -> list[tuple[slice, slice]]:
        n = stop - start
        if n <= 0:
            return []
        assert n <= self.window
        first = start % self.window
        head = min(n, self.window - first)
        spans = [(slice(first, first + head), slice(start, start + head))]
        if head < n:
            spans.append((slice(0, n - head), slice(start + head, stop)))
        return spans

    def _grow_host(self, rows: int) -> None:
        """Host rows for at least `rows` positions a layer: doubled, capped at max_length - window; the old
        rows are copied once every copy touching them has finished."""
        old = 0 if self.host_k is None else self.host_k.shape[1]
        cap = min(self.max_length - self.window, max(rows, 2 * old))
        row_bytes = self.n_layers * self.format.cell_bytes(self._heads * self._head_dim)  # a position, keys and values
        pad = self.format.storage(self.format.values).itemsize  # more than aligning the values may cost
        flat = self.staging.pool.take(cap * row_bytes + pad)
        cap = min(self.max_length - self.window, (flat.numel() - pad) // row_bytes)  # all the rows the buffer holds
        k, v = split_cells(flat, self.format, cap, self._heads, self._head_dim, self.n_layers)  # [L, C, Hkv, R]
        if self.host_k is not None:
            _drain_before_free(self.staging, self.owner)
            host_k, host_v = self._host_rows()
            k[:, :old] = host_k  # host to host: done when this returns
            v[:, :old] = host_v
        self.host_k, self.host_v = k, v
        while self._host_buffers:
            self.staging.pool.give(self._host_buffers.pop())
        self._host_buffers.append(flat)
        if self._finalizer is None:
            self._finalizer = weakref.finalize(self, _release_host, self.staging, self.owner, self._host_buffers)
            self._finalizer.atexit = False


def _spans(format: KVFormat, n_rows: int, head_dim: int) -> tuple[int, int]:
    """Bytes of `n_rows` head rows of keys, padded to the values' alignment, and of values."""
    f = format
    k_bytes = n_rows * f.row(f.keys, head_dim) * f.storage(f.keys).itemsize
    v_item = f.storage(f.values).itemsize
    return -(-k_bytes // v_item) * v_item, n_rows * f.row(f.values, head_dim) * v_item


def cells_nbytes(format: KVFormat, cells: int, n_kv_heads: int, head_dim: int, *lead: int) -> int:
    return sum(_spans(format, math.prod(lead) * cells * n_kv_heads, head_dim))


def split_cells(flat: torch.Tensor, format: KVFormat, cells: int, n_kv_heads: int, head_dim: int,
                *lead: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [*lead, cells, Hkv, R], views of `flat` (keys first; `cells_nbytes` at least)."""
    f = format
    k_span, v_bytes = _spans(f, math.prod(lead) * cells * n_kv_heads, head_dim)
    k = flat[:k_span].view(f.storage(f.keys))[:math.prod(lead) * cells * n_kv_heads * f.row(f.keys, head_dim)]
    v = flat[k_span:k_span + v_bytes].view(f.storage(f.values))
    return (k.view(*lead, cells, n_kv_heads, f.row(f.keys, head_dim)),
            v.view(*lead, cells, n_kv_heads, f.row(f.values, head_dim)))


def window_bytes(spec: ModelSpec, n_layers: int, cells: int, elem: int = 2,
                 kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV) -> int:
    return n_layers * cells * kv_cell_bytes(*kv_types, spec.kv_dim, elem)


def staging_bytes(spec: ModelSpec, max_length: int, prefetch: bool, elem: int = 2,
                  kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV) -> int:
    """VRAM of a stage's `KVStaging` for sequences of up to `max_length` tokens."""
    return (2 if prefetch else 1) * max_length * kv_cell_bytes(*kv_types, spec.kv_dim, elem)


def make_kv_cache(spec: ModelSpec, layers: range, vram_cells: int, max_length: int, *, device: torch.device,
                  dtype: torch.dtype, staging: KVStaging | None,
                  kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV) -> KVCache | TwoTierKV:
    """A sequence's KV for a stage's `layers`: a plain `KVCache` when `max_length` fits in
    `vram_cells`, else a `TwoTierKV` with that window, assembling in the stage's `staging`."""
    # Laid out whole at once: growing by doubling would hold the old and the new cache together
    # for a moment (1.5x the cells the plan counted): more than the VRAM plan leaves a long prompt.
    if max_length <= vram_cells:
        return KVCache(len(layers), spec.n_kv_heads, spec.head_dim, capacity=max_length, max_length=max_length,
                       device=device, dtype=dtype, keys=kv_types[0], values=kv_types[1])
    if staging is None:
        raise ValueError(f"a sequence of {max_length} tokens needs host KV beyond {vram_cells} VRAM cells, "
                         f"and no staging buffer was given")
    return TwoTierKV(len(layers), spec.n_kv_heads, spec.head_dim, window=vram_cells, max_length=max_length,
                     staging=staging, capacity=vram_cells, dtype=dtype, kv_types=kv_types)
