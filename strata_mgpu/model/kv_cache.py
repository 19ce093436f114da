"""A sequence's KV as the decoder sees it (`SequenceKV`), and its plain form, `KVCache`: keys and
values of every layer, grown by doubling. A stage's two-tier cache (`stage.kv.two_tier`) keeps
the older cells in host RAM behind the same contract."""

from __future__ import annotations

from typing import Protocol

import torch


class SequenceKV(Protocol):
    """One sequence's keys and values for a decoder's layers.

    `length` counts the positions written by completed forwards. A forward reserves its rows,
    writes each layer's keys and values (`write`, which returns every key and value up to them
    for attention), then advances. `k`/`v` [L, capacity, Hkv, Dh] hold the cells in VRAM; where
    `graph_capturable` they hold every cell at its own position, so the decode step's kernels may
    read and write them in place by address."""

    k: torch.Tensor
    v: torch.Tensor
    length: int
    max_length: int

    @property
    def capacity(self) -> int: ...

    @property
    def graph_capturable(self) -> bool:
        """Every cell, the next one's included, sits in `k`/`v` at its own position."""
        ...

    @property
    def offset_writes(self) -> bool:
        """`write` takes rows `at` an offset past the cached ones (a forward in two halves)."""
        ...

    @property
    def rows_in_place(self) -> bool:
        """Every row it can hold sits in `k`/`v` at its own position, for its whole life: rows read
        from there are the forwards' keys and values, and rows copied there before `advance` read as
        if a forward wrote them. What the prefix cache saves blocks from and restores them into."""
        ...

    @property
    def nbytes(self) -> int:
        """VRAM its cells take."""
        ...

    def reserve(self, new_tokens: int) -> None:
        """Room for `new_tokens` more (ValueError past max_length)."""
        ...

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, at: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [T, Hkv, Dh] keys/values `at` rows past the cached ones; all keys/values up to
        them [length + at + T, Hkv, Dh]."""
        ...

    def advance(self, n: int) -> None: ...

    def prefetch(self, layer: int) -> None:
        """Start bringing `layer`'s cells that live elsewhere (host RAM) to the device, a layer
        ahead of its attention; a no-op where every cell is in VRAM."""
        ...

    def drain(self) -> None:
        """A forward failed: wait for the copies `prefetch` started, forget them."""
        ...


class KVCache:
    """Keys and values of one sequence for `n_layers` layers.

    Layout per layer: [capacity, Hkv, Dh]. `length` counts the positions written by completed
    forwards; a forward writes rows [length, length + T) in every layer, then calls `advance(T)`.
    Unwritten rows are zeros, never garbage: the static decode step attends over the whole
    capacity under a mask, and a masked NaN would still poison the softmax and P @ V.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, capacity: int = 256,
                 max_length: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        assert capacity > 0 and max_length > 0
        self.max_length = max_length
        self.length = 0
        cap = min(capacity, max_length)
        self.k = torch.zeros(n_layers, cap, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def graph_capturable(self) -> bool:
        """Every cell sits in `k`/`v` at its own position: the static decode step may read them."""
        return True

    @property
    def offset_writes(self) -> bool:
        return True

    @property
    def rows_in_place(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def reserve(self, new_tokens: int) -> None:
        need = self.length + new_tokens
        if need > self.max_length:
            raise ValueError(f"sequence of {need} tokens exceeds the context of {self.max_length}")
        if need <= self.capacity:
            return
        cap = min(self.max_length, max(need, 2 * self.capacity))
        k = torch.zeros(self.k.shape[0], cap, *self.k.shape[2:], device=self.k.device, dtype=self.k.dtype)
        v = torch.zeros_like(k)
        k[:, :self.length] = self.k[:, :self.length]
        v[:, :self.length] = self.v[:, :self.length]
        self.k, self.v = k, v

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, at: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [T, Hkv, Dh] keys/values `at` rows past the cached ones (a forward's later rows,
        its earlier ones written first); return all of them up to the new ones [length+at+T, Hkv, Dh]."""
        start = self.length + at
        end = start + k_new.shape[0]
        assert end <= self.capacity, "reserve() before writing"
        self.k[layer, start:end] = k_new
        self.v[layer, start:end] = v_new
        return self.k[layer, :end], self.v[layer, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def prefetch(self, layer: int) -> None:
        """Every cell is in VRAM: nothing to bring."""

    def drain(self) -> None:
        """Nothing in flight."""
