"""The stage's link to host memory, measured once: pinned host-to-device bytes/s."""

from __future__ import annotations

import statistics
import weakref

import torch

from strata_mgpu.stage.device import DeviceContext

_LINK_RATES: weakref.WeakKeyDictionary[DeviceContext, float] = weakref.WeakKeyDictionary()


def measure_link_rate(ctx: DeviceContext, nbytes: int = 128 * 2**20, repeats: int = 3) -> float | None:
    """Pinned host-to-device bytes/s on the stage's upload stream, the median of `repeats` copies after
    a warm-up; None on the CPU. Two stages on one card each see the whole link here: the policy
    knows they share it."""
    if not ctx.is_cuda:
        return None
    assert ctx.upload is not None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
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
