"""GLM-4.5's router (glm4moe): sigmoid scores, a per-expert correction bias that steers the choice
only, grouped top-k, the picks' scores renormalized and scaled. As transformers' Glm4MoeTopkRouter
and llama.cpp's `build_moe_ffn` with sigmoid gating compute it.

Shape legend: T = token rows, D = hidden, E = experts, A = experts used per token, G = groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SigmoidRouting:
    """`{arch}.expert_group_count` (G), `expert_group_used_count`, `expert_weights_norm`,
    `expert_weights_scale` (transformers' n_group, topk_group, norm_topk_prob, routed_scaling_factor)."""

    n_groups: int = 1  # G: experts split in G equal groups, E / G each
    groups_used: int = 1  # a token picks its experts within its best groups_used groups
    normalize: bool = True  # the A picks' scores divided by their sum
    scale: float = 1.0  # then multiplied by this


def route_sigmoid(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, n_used: int, r: SigmoidRouting
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D], router [E, D], bias [E] -> (weights [T, A] fp32, experts [T, A]). A group ranks by
    the sum of its best two biased scores; the weights are the unbiased scores of the picks."""
    scores = torch.sigmoid(h.float() @ router.float().T)  # [T, E]
    choice = scores + bias.float()  # [T, E]: the bias moves the choice, not the weights
    t, e = choice.shape
    if r.n_groups > 1:
        grouped = choice.view(t, r.n_groups, e // r.n_groups)  # [T, G, E/G]
        group_rank = grouped.topk(min(2, e // r.n_groups), dim=-1).values.sum(-1)  # [T, G]
        best = group_rank.topk(r.groups_used, dim=-1).indices  # [T, groups_used]
        kept = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        choice = grouped.masked_fill(~kept[:, :, None], float("-inf")).view(t, e)
    experts = choice.topk(n_used, dim=-1).indices  # [T, A]
    weights = scores.gather(1, experts)  # [T, A]
    if r.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * r.scale, experts
