"""All-to-all token dispatch over the expert-parallel group (GShard, arXiv 2006.16668).

Rank r owns experts [r*L, (r+1)*L). Dispatch: sort local tokens by global expert (so each
destination rank's rows are contiguous), exchange the per-expert counts, exchange the rows, then
reorder the received rows from (source rank, local expert) to (local expert, source rank) so each
local expert's rows are contiguous for the grouped GEMM. Combine runs the same steps backwards and
applies the gates on the source rank. Zero-size sends and receives are ordinary cases. With a
group of one rank every exchange is the identity and this is the single-process dispatcher.

Shape legend: T tokens, D hidden, E experts, L local experts, R ranks, N rows.
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
class AllToAllState:
    """What combine needs to undo a dispatch."""

    perm: Permutation
    gates_TE: torch.Tensor
    num_tokens: int
    send_splits: list[int]
    recv_splits: list[int]
    expert_order_N: torch.Tensor  # received row -> expert-major position


def expert_major_order(counts_RL: torch.Tensor) -> torch.Tensor:
    """Indices that reorder rows laid out by (source rank, local expert) into (local expert,
    source rank) order; counts_RL[r, l] rows came from rank r for local expert l."""
    R, L = counts_RL.shape
    chunk_key_RL = torch.arange(L, device=counts_RL.device).repeat(R, 1) * R + \
        torch.arange(R, device=counts_RL.device).unsqueeze(1)
    row_keys_N = chunk_key_RL.flatten().repeat_interleave(counts_RL.flatten())
    return torch.argsort(row_keys_N, stable=True)


@DISPATCHERS.register("alltoall", config=DispatcherConfig)
class AllToAllDispatcher:
    """Dispatch to the experts of all ranks of `comm` with one all-to-all each way."""

    def __init__(self, num_experts: int, comm: Comm):
        self.comm = comm
        self.num_local_experts = num_experts // comm.size

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        """Rows for this rank's experts in expert-major order, rows per local expert, state."""
        perm = sort_by_expert(routing.routing_map_TE)
        rows_ND = permute(x_TD, perm)
        R, L = self.comm.size, self.num_local_experts
        send_counts_RL = perm.tokens_per_expert_E.view(R, L)
        if R == 1:
            state = AllToAllState(perm, routing.gates_TE, x_TD.shape[0], [], [], None)
            return rows_ND, send_counts_RL[0].tolist(), state
        recv_counts_RL = send_counts_RL.new_empty((R, L))
        recv_counts_RL.copy_(self.comm.all_to_all(send_counts_RL, [1] * R, [1] * R))
        send_splits = send_counts_RL.sum(1).tolist()
        recv_splits = recv_counts_RL.sum(1).tolist()
        received_ND = all_to_all(self.comm, rows_ND, recv_splits, send_splits)
        order_N = expert_major_order(recv_counts_RL)
        state = AllToAllState(perm, routing.gates_TE, x_TD.shape[0], send_splits, recv_splits,
                              order_N)
        return received_ND.index_select(0, order_N), recv_counts_RL.sum(0).tolist(), state

    def combine(self, y_ND: torch.Tensor, state: AllToAllState) -> torch.Tensor:
        """Send expert outputs back to their tokens' ranks and sum them weighted by the gates."""
        if self.comm.size > 1:
            back_ND = torch.empty_like(y_ND).index_copy(0, state.expert_order_N, y_ND)
            y_ND = all_to_all(self.comm, back_ND, state.send_splits, state.recv_splits)
        return unpermute(y_ND, state.perm, state.gates_TE, state.num_tokens)
