"""Per-sequence KV cache: keys and values of every layer, grown by doubling."""

from __future__ import annotations

import torch


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
