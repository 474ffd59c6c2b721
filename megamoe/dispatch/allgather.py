"""All-gather token dispatch over the expert-parallel group (the scheme of Megatron-Core's
`allgather` dispatcher; expert parallelism as in GShard, arXiv 2006.16668).

Rank r owns experts [r*L, (r+1)*L). Dispatch: every rank receives every rank's tokens (an
all-gather) and, for its own experts only, their gates and routing map; it then sorts the tokens
routed to its experts by expert. Combine: each rank sums its experts' gated outputs per token over
all ranks' tokens, and a reduce-scatter hands every rank the sum over all experts for its own
tokens. The volume does not depend on the routing (each rank receives all G tokens instead of the
about K*T rows an all-to-all moves), which suits small groups and many experts per token.

Both collectives are all-to-alls with routing-independent splits, so ranks may hold different
numbers of tokens (zero included) and the backward is the same exchange reversed. With a group of
one rank every exchange is the identity.

Shape legend: T tokens on this rank, G tokens on all ranks, D hidden, E experts, L local experts,
R ranks, N rows, 2 the (gate, routed) pair of a token and expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.config import DispatcherConfig
from megamoe.dispatch.permute import Permutation, permute, sort_by_expert, unpermute
from megamoe.parallel.comm import Comm, all_to_all
from megamoe.registry import DISPATCHERS
from megamoe.routing.base import Routing


@dataclass(frozen=True)
class AllGatherState:
    """What combine needs to undo a dispatch."""

    perm: Permutation  # over the gathered tokens and this rank's experts
    gates_GL: torch.Tensor
    tokens_per_rank: list[int]


@DISPATCHERS.register("allgather", config=DispatcherConfig)
class AllGatherDispatcher:
    """Dispatch by gathering all tokens on every rank of `comm`; combine by reduce-scatter."""

    def __init__(self, num_experts: int, comm: Comm):
        self.comm = comm
        self.num_local_experts = num_experts // comm.size

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        """Rows for this rank's experts in expert-major order, rows per local expert, state."""
        R, L, T = self.comm.size, self.num_local_experts, x_TD.shape[0]
        counts = self.comm.all_gather(torch.tensor([T], device=x_TD.device))
        tokens_per_rank = torch.cat(counts).tolist()
        x_GD = all_to_all(self.comm, x_TD.repeat(R, 1), tokens_per_rank, [T] * R)
        # Rank q gets only the routing columns of its own experts: block q of the send buffer.
        routing_RTL2 = torch.stack([routing.gates_TE.reshape(T, R, L).transpose(0, 1),
                                    routing.routing_map_TE.reshape(T, R, L).transpose(0, 1)
                                    .to(routing.gates_TE.dtype)], dim=-1)
        routing_GL2 = all_to_all(self.comm, routing_RTL2.reshape(R * T, L, 2), tokens_per_rank,
                                 [T] * R)
        perm = sort_by_expert(routing_GL2[..., 1] > 0)
        state = AllGatherState(perm, routing_GL2[..., 0], tokens_per_rank)
        return permute(x_GD, perm), perm.tokens_per_expert_E.tolist(), state

    def combine(self, y_ND: torch.Tensor, state: AllGatherState) -> torch.Tensor:
        """Gated sum over this rank's experts for all tokens, then reduce-scatter to the owners."""
        R, G = self.comm.size, sum(state.tokens_per_rank)
        out_GD = unpermute(y_ND, state.perm, state.gates_GL, G)
        T = state.tokens_per_rank[self.comm.rank]
        out_RTD = all_to_all(self.comm, out_GD, [T] * R, state.tokens_per_rank)
        return out_RTD.view(R, T, out_GD.shape[1]).sum(0)
