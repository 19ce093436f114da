"""A stage's prefix-cache blocks, every copy queued on the stage's compute stream, behind the
forwards that wrote the rows it reads and ahead of the prefill that reads the rows it loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata_mgpu.model.kv_blocks import KVBlockStore
from strata_mgpu.model.kv_cache import KVFormat, SequenceKV
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.stage.device import DeviceContext


class StageBlocks:
    """`KVBlocks` of one stage's sequences: its `layers`' keys and values as `format` stores them."""

    def __init__(self, ctx: DeviceContext, spec: ModelSpec, layers: range, *, block_tokens: int,
                 format: KVFormat):
        self.ctx = ctx
        self.store = KVBlockStore(len(layers), spec.n_kv_heads, spec.head_dim, block_tokens=block_tokens,
                                  device=ctx.device, format=format)

    @property
    def block_tokens(self) -> int:
        return self.store.block_tokens

    @property
    def block_bytes(self) -> int:
        return self.store.block_bytes

    @property
    def host_tier(self) -> bool:
        return self.store.host_tier

    def cacheable(self, kv: SequenceKV) -> bool:
        return self.store.cacheable(kv)

    @torch.inference_mode()
    def save(self, kv: SequenceKV, index: int) -> torch.Tensor:
        with self.ctx.on_compute():
            return self.store.save(kv, index)

    @torch.inference_mode()
    def offload(self, block: torch.Tensor) -> torch.Tensor:
        with self.ctx.on_compute():
            return self.store.offload(block)

    @torch.inference_mode()
    def load(self, kv: SequenceKV, blocks: Sequence[torch.Tensor], n_tokens: int) -> None:
        with self.ctx.on_compute():
            self.store.load(kv, blocks, n_tokens)
