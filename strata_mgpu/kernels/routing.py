"""Routed rows: grouping them by expert and combining the experts' outputs back into tokens.

Shape legend: T = token rows, A = picks per token, M = T * A routed rows, D = hidden, G = groups.
"""

from __future__ import annotations

import torch


def group_rows(experts: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, A] group ids in [0, G), ids = arange(G) on their device -> (order [M]: routed rows
    sorted by group, offs [G] int32 row ends). Stable, no host sync, and two ops only, since a helped
    prompt's layers are bound by the host's launches."""
    flat = experts.reshape(-1)
    ordered, order = torch.sort(flat, stable=True)
    return order, torch.searchsorted(ordered, ids, right=True, out_int32=True)  # rows with a group <= g


def combine(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sorted expert outputs [M, D] back to rows and weighted: [T, D]. A batched [1, A] x [A, D]
    product per row (fp32 accumulation, no atomics), so the result is repeatable."""
    t, a = weights.shape
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y.view(t, a, -1)).squeeze(1)  # [T, 1, A] @ [T, A, D]


def masked_combine(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, mine: torch.Tensor
                   ) -> torch.Tensor:
    """`combine` over only the picks in `mine` [T, A]; the other picks' rows may hold anything."""
    keep = mine.reshape(-1)[order]  # [M], in sorted order
    y = torch.where(keep[:, None], y_sorted, 0.0)  # a scalar zero: no tensor (and no launch) made for it
    return combine(y, order, torch.where(mine, weights, 0.0))
