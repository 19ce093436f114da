"""Experts resident in VRAM for decode, and a table saying where every expert can be read.

Decode needs only the experts its tokens pick, a few per layer. Those that fit in the VRAM
budget's spare room live in cache slots on the device; every other expert is read by the dequant
kernel straight from the pinned host arena through its device mapping (UVA), at link speed and
with no copy to wait for. `slot_of[layer, expert]` (-1: not resident) and `host_offset` let the
device build each expert's address itself, so a decode step never synchronizes the host.

Which experts stay: an even share of every layer, chosen once when the stage is built (the
first K of each layer). A routing-frequency policy would serve trained models better; the
synthetic models route almost uniformly, so any choice gives them a hit rate of K / E.
"""

from __future__ import annotations

import torch

from strata_mgpu.runtime.device import DeviceContext
from strata_mgpu.runtime.host_arena import HostExpertArena


class ExpertCache:
    def __init__(self, ctx: DeviceContext, arena: HostExpertArena, layers: range, n_slots: int):
        E = arena.spec.n_experts
        self.ctx = ctx
        self.layers = layers
        self.slot_bytes = arena.max_expert_bytes
        per_layer = min(E, n_slots // len(layers))
        self.buffer = torch.empty(per_layer * len(layers), self.slot_bytes, dtype=torch.uint8, device=ctx.device)
        slot_of = torch.full((len(layers), E), -1, dtype=torch.int64)
        host_offset = torch.empty(len(layers), E, dtype=torch.int64)
        for i, layer in enumerate(layers):
            for e in range(E):
                host_offset[i, e] = arena.offsets[layer] + e * arena.layouts[layer].expert_bytes
            for e in range(per_layer):
                slot = i * per_layer + e
                src = arena.expert(layer, e)
                self.buffer[slot, :src.numel()].copy_(src)
                slot_of[i, e] = slot
        self.per_layer = per_layer
        self.slot_of_host = slot_of
        self.slot_of = slot_of.to(ctx.device)  # [L, E]
        self.host_offset = host_offset.to(ctx.device)  # [L, E] bytes from the arena's start
        self.arena = arena
        self.lookups = self.hits = 0  # counted by the torch twin path and by `count` on the device path

    @property
    def n_slots(self) -> int:
        return self.buffer.shape[0]

    @property
    def hit_rate_uniform(self) -> float:
        """Hit rate under uniform routing: the resident share of each layer."""
        return self.per_layer / self.arena.spec.n_experts

    def source(self, i: int, e: int) -> torch.Tensor:
        """Where expert e of local layer i is read from: its cache slot, or the host arena."""
        slot = int(self.slot_of_host[i, e])
        self.lookups += 1
        if slot >= 0:
            self.hits += 1
            return self.buffer[slot]
        return self.arena.expert(self.layers[i], e)

    def addresses(self, i: int, picks: torch.Tensor) -> torch.Tensor:
        """Device addresses (uint64 as int64) of the experts `picks` [M] of local layer i, built on
        the device: a cache slot's, or the mapped arena's."""
        slot = self.slot_of[i, picks]
        cached = self.buffer.data_ptr() + slot.clamp(min=0) * self.slot_bytes
        host = self.arena.buffer.data_ptr() + self.host_offset[i, picks]
        return torch.where(slot >= 0, cached, host)

    def count(self, i: int, picks: torch.Tensor) -> torch.Tensor:
        """Number of resident picks (a device scalar; read it only where a sync is fine)."""
        return (self.slot_of[i, picks] >= 0).sum()
