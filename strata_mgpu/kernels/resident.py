"""What the expert kernels read of a stage's experts: `ResidentExperts`, where each expert of its
layers lives. The stage's expert cache implements it, and so does `tools.bench_kernels`' synthetic one.

Shape legend: L = the stage's layers, E = experts a layer, M = picks.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ResidentExperts(Protocol):
    """Each expert's bytes: in a VRAM slot where resident, else in the pinned host arena, read at its
    host address (UVA). Both tables live on the device, so a decode step builds its experts'
    addresses itself and never waits for the host."""

    slot_of: torch.Tensor  # [L, E] int64 on the device: the expert's slot, -1 where not resident
    host_offset: torch.Tensor  # [L, E] int64 on the device: its bytes' offset in `host`
    slots: torch.Tensor  # uint8 [n_slots, slot_bytes] in VRAM
    slot_bytes: int
    per_layer: int  # experts resident a layer

    @property
    def host(self) -> torch.Tensor:
        """uint8: the arena of every expert, pinned (and mapped) on CUDA."""
        ...

    def addresses(self, i: int, picks: torch.Tensor) -> torch.Tensor:
        """Device addresses (int64) of the experts picks [M] of local layer i, built on the device."""
        ...

    def source(self, i: int, e: int) -> torch.Tensor:
        """uint8 [>= expert bytes]: expert e of local layer i where it is read (the twins' view)."""
        ...
