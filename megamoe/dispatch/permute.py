"""Permute tokens into expert order and back: pure functions.

Shape legend: T tokens, D hidden, E experts, N routed assignments (sum of the routing map).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Permutation:
    """Where each row of an expert-sorted buffer came from."""

    token_idx_N: torch.Tensor
    """Source token of each row."""
    expert_idx_N: torch.Tensor
    """Expert of each row (non-decreasing)."""
    tokens_per_expert_E: torch.Tensor
    """Rows per expert (int64)."""


def sort_by_expert(routing_map_TE: torch.Tensor) -> Permutation:
    """The permutation that groups every (token, expert) assignment by expert, tokens in order."""
    expert_idx_N, token_idx_N = routing_map_TE.t().nonzero(as_tuple=True)
    return Permutation(token_idx_N, expert_idx_N, routing_map_TE.sum(0))


def permute(x_TD: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Rows of x in expert order: one row per assignment."""
    return x_TD.index_select(0, perm.token_idx_N)


def unpermute(y_ND: torch.Tensor, perm: Permutation, gates_TE: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """Weighted combine: out[t] = sum over t's experts e of gate[t, e] * y[row of (t, e)]."""
    gates_N1 = gates_TE[perm.token_idx_N, perm.expert_idx_N].unsqueeze(1).to(y_ND.dtype)
    out_TD = y_ND.new_zeros((num_tokens, y_ND.shape[1]))
    return out_TD.index_add(0, perm.token_idx_N, y_ND * gates_N1)
