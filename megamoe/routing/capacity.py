"""Expert capacity: drop assignments beyond a per-expert budget (GShard, arXiv 2006.16668).

Capacity is computed from the realised number of assignments, so it also holds for routers with a
variable number of experts per token: capacity = ceil(capacity_factor * assignments / E).
"""
from __future__ import annotations

import math

import torch

from megamoe.routing.base import Routing


def expert_capacity(num_assignments: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert may take in this forward call."""
    return max(1, math.ceil(capacity_factor * num_assignments / num_experts))


def apply_capacity(routing: Routing, capacity_factor: float, drop_policy: str) -> Routing:
    """Keep at most `capacity` tokens per expert: the highest gates (`probs`) or the earliest
    tokens (`position`); dropped assignments leave the dispatch map and their gates become 0."""
    selected_TE = routing.selected_TE
    T, E = selected_TE.shape
    capacity = expert_capacity(int(selected_TE.sum()), E, capacity_factor)
    if capacity >= T:
        return routing
    if drop_policy == "probs":
        priority_TE = routing.gates_TE.detach().masked_fill(~selected_TE, float("-inf"))
    else:
        position_T1 = torch.arange(T, 0, -1, device=selected_TE.device).unsqueeze(1)
        priority_TE = (position_T1 * selected_TE).to(torch.float32)
        priority_TE = priority_TE.masked_fill(~selected_TE, float("-inf"))
    keep_idx_CE = priority_TE.topk(capacity, dim=0).indices
    keep_TE = torch.zeros_like(selected_TE)
    keep_TE.scatter_(0, keep_idx_CE, True)
    return routing.with_map(selected_TE & keep_TE)
