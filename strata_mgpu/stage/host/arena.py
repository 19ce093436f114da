"""The host expert arena: every layer's routed experts in one pinned host buffer.

Layout: layer after layer; inside a layer, expert after expert; inside an expert its raw GGUF
blocks as [gate | up | down]. So one layer, one expert and a run of experts are each one
contiguous slice. The file's pages each layer was copied from leave the process's resident set
once copied (`release_file_pages`), so the experts are not counted twice.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

import numpy as np
import torch

from strata_mgpu.model.expert_layout import layer_layout
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import ModelSpec, T, tname
from strata_mgpu.stage.host.pinned import pin_in_place


class HostExpertArena:
    """Experts of `layers` in host memory, pinned when `pin` (needs CUDA)."""

    def __init__(self, f: GGUFFile, spec: ModelSpec, layers: range, *, pin: bool,
                 on_layer: Callable[[int], None] | None = None):
        self.spec = spec
        self.layers = layers
        self.layouts = {i: layer_layout(f, spec, i) for i in layers}
        self.offsets: dict[int, int] = {}
        total = 0
        for i in layers:
            self.offsets[i] = total
            total += spec.n_experts * self.layouts[i].expert_bytes
        self.nbytes = total
        self._host = np.empty(total, dtype=np.uint8)  # anonymous memory: resident as it is filled
        for i in layers:
            self._fill(f, i)
            if on_layer:
                on_layer(i)
        if pin:
            pin_in_place(self._host)
        self.pinned = pin
        self.buffer = torch.from_numpy(self._host)

    def _fill(self, f: GGUFFile, layer: int) -> None:
        lay, E = self.layouts[layer], self.spec.n_experts
        dst = self._host[self.offsets[layer]:self.offsets[layer] + E * lay.expert_bytes].reshape(E, lay.expert_bytes)
        for kind, start, size in ((T.FFN_GATE_EXP, 0, lay.gate_bytes), (T.FFN_UP_EXP, lay.gate_bytes, lay.gate_bytes),
                                  (T.FFN_DOWN_EXP, lay.down_offset, lay.down_bytes)):
            src = f.tensor_data(tname(kind, layer))
            dst[:, start:start + size] = src.reshape(E, size)
            release_file_pages(src)

    def layer(self, layer: int) -> torch.Tensor:
        """uint8 [E * expert_bytes]: the whole layer."""
        start = self.offsets[layer]
        return self.buffer[start:start + self.spec.n_experts * self.layouts[layer].expert_bytes]

    def expert(self, layer: int, e: int) -> torch.Tensor:
        """uint8 [expert_bytes]: one expert's gate, up and down."""
        size = self.layouts[layer].expert_bytes
        start = self.offsets[layer] + e * size
        return self.buffer[start:start + size]

    def experts(self, layer: int, first: int, stop: int) -> torch.Tensor:
        """uint8 [(stop - first) * expert_bytes]: experts first..stop-1 of a layer."""
        size = self.layouts[layer].expert_bytes
        start = self.offsets[layer]
        return self.buffer[start + first * size:start + stop * size]

    @property
    def max_layer_bytes(self) -> int:
        return max(self.spec.n_experts * lay.expert_bytes for lay in self.layouts.values())

    @property
    def max_expert_bytes(self) -> int:
        return max(lay.expert_bytes for lay in self.layouts.values())


def release_file_pages(src: np.ndarray) -> None:
    """Drop the whole pages `src` spans from this process's resident set, where `src` is a view of a
    read-only file mapping: the pages stay in the page cache. Nothing for any other array (on
    anonymous memory MADV_DONTNEED would discard the bytes themselves)."""
    if not (isinstance(src, np.memmap) and not src.flags.writeable and src.flags.c_contiguous)\
            or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = -(-src.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only
    stop = (src.ctypes.data + src.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if stop > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)
