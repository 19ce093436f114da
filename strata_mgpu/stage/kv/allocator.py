"""The KV of a stage's sequences within its VRAM plan: `StageKV`.

The plan keeps `kv_tokens` cells in VRAM for all sequences together; a longer sequence keeps its
last cells in VRAM and the older ones in pinned host RAM (`two_tier.TwoTierKV`), assembled in a
staging buffer the stage shares, made at the first long sequence.
"""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.kv_cache import PLAIN_KV, KVCache, KVFormat
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.kv.two_tier import KVStaging, TwoTierKV, make_kv_cache


class StageKV:
    """Makes each sequence's KV for a stage's `layers`: `vram_cells` for all sequences together,
    sequences of up to `context` tokens; `prefetch`: spilled cells uploaded a layer ahead on a side
    stream; `kv_types`: how the cells are stored."""

    def __init__(self, ctx: DeviceContext, spec: ModelSpec, layers: range, *, vram_cells: int, context: int,
                 dtype: torch.dtype, prefetch: bool,
                 kv_types: tuple[GGMLQuantizationType, GGMLQuantizationType] = PLAIN_KV):
        self.ctx, self.spec, self.layers, self.dtype, self.prefetch = ctx, spec, layers, dtype, prefetch
        self.format = KVFormat(dtype, *kv_types)
        self.vram_cells = vram_cells
        self.max_context = max(context, vram_cells)  # the longest sequence planned for
        self._staging: KVStaging | None = None

    def cells(self, tokens: int) -> int:
        """VRAM KV cells a sequence of `tokens` takes (the rest of a longer one lives in host RAM)."""
        return min(tokens, self.vram_cells)

    def new_sequence(self, max_length: int) -> KVCache | TwoTierKV:
        """All in VRAM when it fits the plan's KV cells, else a two-tier cache."""
        if max_length > self.max_context:
            raise ValueError(f"a sequence of {max_length} tokens exceeds the {self.max_context} this stage planned "
                             f"its KV for")
        with self.ctx.on_compute():
            staging = None
            if max_length > self.vram_cells:
                if self._staging is None:  # one buffer for the planned context, as the plan counted it
                    self._staging = KVStaging.for_model(self.spec, self.max_context, ctx=self.ctx, dtype=self.dtype,
                                                        kv_types=self.format.types,
                                                        prefetch=self.prefetch)
                staging = self._staging
            return make_kv_cache(self.spec, self.layers, self.vram_cells, max_length, device=self.ctx.device,
                                 dtype=self.dtype, staging=staging, kv_types=self.format.types)
