"""Which experts of a layer a device computes in one prompt pass, where each is read, and the
functions that compute them, for the busy stage's part and its helper's alike (a pass in two
halves of rows calls `load_part` once and `part_rows` for each half).

Shape legend: T = token rows, D = hidden, E = experts, A = picks per token, M = T * A routed
rows, n = experts in the part, F = expert width.

A layer's experts are resident (a VRAM cache slot of the owning stage) or streamed (uploaded for
this pass into a ring slot, packed in id order). A part lists its experts resident first;
`local_of` maps every expert id to its index in the part (n: not in the part), so the rows routed
to the part sort first and its results are masked in when the part is not the whole layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.kernels.routing import combine, group_rows, masked_combine
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.host.arena import HostExpertArena


@dataclass(frozen=True)
class LayerPart:
    """The experts of one layer one device computes in one pass."""

    layer: int  # global layer id
    resident: tuple[tuple[int, int], ...]  # (expert id, cache slot) read from VRAM
    streamed: tuple[int, ...]  # expert ids read from the pass's ring slot, packed in this order

    @property
    def ids(self) -> list[int]:
        return [e for e, _ in self.resident] + list(self.streamed)

    @property
    def n(self) -> int:
        return len(self.resident) + len(self.streamed)

    def runs(self, arena: HostExpertArena) -> list[torch.Tensor]:
        """The streamed experts' bytes as runs of consecutive ids (one copy each), in packing order."""
        out: list[torch.Tensor] = []
        start: int | None = None
        prev = -2
        for e in self.streamed:
            if e == prev + 1:
                prev = e
                continue
            if start is not None:
                out.append(arena.experts(self.layer, start, prev + 1))
            start = prev = e
        if start is not None:
            out.append(arena.experts(self.layer, start, prev + 1))
        return out


def split_layer(layer: int, resident: dict[int, int], n_experts: int, n_help: int) -> tuple[LayerPart, LayerPart]:
    """(the owner's part, the helper's part): the helper takes the last `n_help` streamed experts."""
    streamed = [e for e in range(n_experts) if e not in resident]
    assert 0 <= n_help <= len(streamed)
    keep = len(streamed) - n_help
    own = LayerPart(layer, tuple(sorted(resident.items())), tuple(streamed[:keep]))
    return own, LayerPart(layer, (), tuple(streamed[keep:]))


class PartTables:
    """A pass's parts on one device: per local layer the id map [E] and the address table [n], built
    on the host for every layer at once and copied to the device in one non-blocking copy on the
    current stream (the caller's, which later reads them)."""

    def __init__(self, parts: list[LayerPart], arena: HostExpertArena, device: torch.device,
                 cache_slot: Callable[[int], torch.Tensor] | None, ring_slot: Callable[[int], torch.Tensor | None]):
        self.parts, self.arena = parts, arena
        self.cache_slot, self.ring_slot = cache_slot, ring_slot  # (slot) -> VRAM bytes; (local layer) -> slot buffer
        E = arena.spec.n_experts
        n = max((p.n for p in parts), default=0)
        local_of = np.full((len(parts), E), n, dtype=np.int64)
        addresses = np.zeros((len(parts), max(n, 1)), dtype=np.int64)
        for i, p in enumerate(parts):  # built on the CPU too, where the twin checks them against its sources
            local_of[i, p.ids] = np.arange(p.n)
            lay = arena.layouts[p.layer]
            for j, (_, slot) in enumerate(p.resident):
                addresses[i, j] = self._cache(slot).data_ptr()
            if p.streamed:
                base = self._ring(i).data_ptr()
                at = len(p.resident)
                addresses[i, at:at + len(p.streamed)] = base + lay.expert_bytes * np.arange(len(p.streamed))
        both = torch.from_numpy(np.concatenate([local_of, addresses], axis=1))
        if device.type == "cuda":
            both = both.pin_memory().to(device, non_blocking=True)
        self.local_of, self.addresses = both[:, :E], both[:, E:]

    def sources(self, i: int) -> list[torch.Tensor]:
        p = self.parts[i]
        eb = self.arena.layouts[p.layer].expert_bytes
        out = [self._cache(slot)[:eb] for _, slot in p.resident]
        if p.streamed:
            ring = self._ring(i)
            out += [ring[k * eb:(k + 1) * eb] for k in range(len(p.streamed))]
        return out

    def _cache(self, slot: int) -> torch.Tensor:
        assert self.cache_slot is not None, "a part with resident experts comes with its stage's cache"
        return self.cache_slot(slot)

    def _ring(self, i: int) -> torch.Tensor:
        buffer = self.ring_slot(i)
        assert buffer is not None, "a part with streamed experts has a ring slot"
        return buffer


@dataclass(frozen=True)
class ExpertWorkspace:
    """Where a device computes a part: its context and kernels, and one layer's experts as bf16
    (w_gate_up [E, 2F, D], w_down [E, D, F]): a stage's own, or the one an idle stage lends."""

    ctx: DeviceContext
    kernels: TorchKernels
    w_gate_up: torch.Tensor
    w_down: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (self.w_gate_up.numel() + self.w_down.numel()) * self.w_gate_up.element_size()


class Routed(NamedTuple):
    """Token rows and their routing: h [T, D], weights [T, A] fp32, experts [T, A]."""

    h: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor


def load_part(ws: ExpertWorkspace, tables: PartTables, i: int, release: Callable[[], None]) -> None:
    """Dequantize local layer i's part's n experts into the workspace, then call `release` (the dequant
    was the ring slot's only reader). Needs no activations: the helper queues it before its inputs arrive."""
    n = tables.parts[i].n
    if n > 0:
        lay = tables.arena.layouts[tables.parts[i].layer]
        ws.ctx.access((ws.w_gate_up, ws.w_down), "w")  # its own or lent: declared for the ordering twin
        ws.kernels.dequant_addressed(tables.addresses[i, :n], lambda: tables.sources(i), lay, n, ws.w_gate_up,
                                     ws.w_down)
    release()


def part_rows(ws: ExpertWorkspace, tables: PartTables, i: int, rows: Routed, whole_layer: bool) -> torch.Tensor:
    """The grouped GEMM pair over the rows routed to local layer i's loaded part: the weighted sum over
    the part's picks [T, D]; picks outside the part count zero."""
    n = tables.parts[i].n
    h, weights, experts = rows
    if n == 0:
        return torch.zeros_like(h)
    local = tables.local_of[i][experts]  # [T, A]: the part's experts become 0..n-1, the rest n
    order, offs = group_rows(local, ws.kernels.expert_ids(n + 1, local.device))  # the part's rows sort first
    ws.ctx.access((ws.w_gate_up, ws.w_down), "r")
    y = ws.kernels.grouped_mlp(h[order // experts.shape[1]], offs[:n], ws.w_gate_up[:n], ws.w_down[:n])  # [M, D]
    if whole_layer:
        return combine(y, order, weights)
    return masked_combine(y, order, weights, local < n)


def compute_part(ws: ExpertWorkspace, tables: PartTables, i: int, rows: Routed, release: Callable[[], None],
                 whole_layer: bool) -> torch.Tensor:
    load_part(ws, tables, i, release)
    return part_rows(ws, tables, i, rows, whole_layer)
