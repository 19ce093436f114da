"""A stage's part of the KV pool: its layers' cells of every block (`KVStorage`, in VRAM within the
plan's KV line), every copy of a block queued on the stage's compute stream, behind the forwards that
wrote the cells it reads and ahead of those that read the cells it writes.
"""

from __future__ import annotations

import torch

from strata_mgpu.model.kv_pool import BlockPool, KVStorage, StoragePool
from strata_mgpu.stage.device import DeviceContext


class StagePool(StoragePool):
    """`StoragePool` with its copies on `ctx`'s compute stream."""

    def __init__(self, ctx: DeviceContext, blocks: BlockPool, storage: KVStorage):
        super().__init__(blocks, storage)
        self.ctx = ctx

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        with self.ctx.on_compute():
            super().copy_block(src, dst)

    @torch.inference_mode()
    def offload(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.ctx.on_compute():
            return super().offload(block)

    @torch.inference_mode()
    def load(self, data: tuple[torch.Tensor, torch.Tensor], block: int) -> None:
        with self.ctx.on_compute():
            super().load(data, block)
