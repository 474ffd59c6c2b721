"""Skywork-MoE's adaptive auxiliary-loss coefficient (Wei et al., arXiv 2406.06563, section 3.2).

Each MoE layer l keeps its own coefficient alpha_l, updated once per optimizer step from the
layer's token-drop rate d_l of that step: alpha_l <- beta * alpha_l + (1 - beta) * xi * d_l
(beta `adaptive_aux_decay`, xi `adaptive_aux_sensitivity`). A layer that drops tokens gets a
stronger balance loss, a balanced one a weaker one. The coefficient weighs the Switch loss of
balancing kind `adaptive_aux_loss`; it lives in the router's fp32 buffer `adaptive_aux_coeff`,
so it is saved in checkpoints and replicated like the expert bias.
"""
from __future__ import annotations

from typing import Optional

import torch


def drop_rate(selected_E: torch.Tensor, routed_E: torch.Tensor,
              capacity_factor: Optional[float]) -> torch.Tensor:
    """The step's token-drop rate: the share of assignments capacity dropped, or, dropless, the
    share of assignments above capacity factor 1 (sum_i max(c_i - mean(c), 0) / sum(c))."""
    total = selected_E.sum().clamp_min(1.0)
    if capacity_factor is not None:
        return 1.0 - routed_E.sum() / total
    return (selected_E - selected_E.mean()).clamp_min(0.0).sum() / total


@torch.no_grad()
def update_coefficient(coeff: torch.Tensor, rate: torch.Tensor, decay: float,
                       sensitivity: float) -> None:
    """In place: alpha <- decay * alpha + (1 - decay) * sensitivity * rate."""
    coeff.mul_(decay).add_((1.0 - decay) * sensitivity * rate.to(coeff.dtype))
