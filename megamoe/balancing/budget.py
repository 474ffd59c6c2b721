"""LongCat-Flash's computational-budget control (arXiv 2509.01322, section 2.1) for layers with
zero-computation experts.

The router chooses its top-k among N real and Z identity experts, so the compute per token
varies; the expert bias steers the mean number of real experts per token to a budget K_e
(`experts.real_experts_per_token`): each real expert's bias moves towards its share of that
budget, a load of T K_e / N of the step's T tokens, by the loss-free balancing step (Wang et al.,
arXiv 2408.15664) u * sign(T K_e / N - c_i), while the identity experts' biases stay at 0. Real
experts are balanced among themselves, and together take K_e per token on average.
"""
from __future__ import annotations

import torch


def budget_update(counts_N: torch.Tensor, tokens: torch.Tensor, budget: float,
                  rate: float) -> torch.Tensor:
    """The step's bias change of the N real experts, from their loads `counts_N` over `tokens`
    tokens and the budget of real experts per token."""
    target = tokens * budget / counts_N.numel()
    return rate * torch.sign(target - counts_N)
