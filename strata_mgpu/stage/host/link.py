"""The stage's link to host memory, measured once: pinned host-to-device bytes/s."""

from __future__ import annotations

import statistics
import weakref

import torch

from strata_mgpu.stage.device import DeviceContext

_LINK_RATES: weakref.WeakKeyDictionary[DeviceContext, float] = weakref.WeakKeyDictionary()


def measure_link_rate(ctx: DeviceContext, nbytes: int = 128 * 2**20, repeats: int = 3,
                      into: torch.Tensor | None = None) -> float | None:
    """Pinned host-to-device bytes/s on the stage's upload stream, the median of `repeats` copies after
    a warm-up; None on the CPU. Two stages on one card each see the whole link here: the policy
    knows they share it. `into`: VRAM the stage owns and nothing uses yet (a ring slot), copied into
    instead of a new allocation of `nbytes` (at most its size)."""
    if not ctx.is_cuda:
        return None
    assert ctx.upload is not None
    if into is not None:
        nbytes = min(nbytes, into.numel())
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = into.view(torch.uint8).view(-1)[:nbytes] if into is not None else torch.empty(
        nbytes, dtype=torch.uint8, device=ctx.device)
    seconds = []
    with ctx.use(ctx.upload):
        for _ in range(repeats + 1):
            start = ctx.mark()
            dst.copy_(src, non_blocking=True)
            seconds.append(ctx.mark().seconds_since(start))
    rate = nbytes / statistics.median(seconds[1:])
    _LINK_RATES[ctx] = rate
    return rate


def link_rate(ctx: DeviceContext) -> float | None:
    return _LINK_RATES.get(ctx)
