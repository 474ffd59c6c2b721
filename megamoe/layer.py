"""MoELayer: router -> dispatcher -> experts -> combine (+ shared expert).

Shape legend: S sequence, B micro-batch, D hidden, T = S * B tokens, E experts, N rows.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from torch import nn

from megamoe.balancing.losses import entropy_loss, sequence_aux_loss, switch_aux_loss, z_loss
from megamoe.config import MoEConfig
from megamoe.dispatch import DISPATCHERS
from megamoe.experts import GroupedExperts, SharedExpert
from megamoe.parallel.comm import Comm, SingleComm
from megamoe.parallel.overlap import join_side_stream, start_on_side_stream
from megamoe.routing import ROUTERS, Routing, apply_capacity


class MoELayer(nn.Module):
    """A Mixture-of-Experts MLP whose experts may be spread over an expert-parallel group.

    ep_comm: the expert-parallel group; this rank holds experts [rank*L, (rank+1)*L), L = E/size.
    replica_comm: every rank holding a replica of this router (data x context x tensor x expert
        parallel); the global aux loss counts assignments over it.
    Balance losses are attached to the output's gradient (Megatron-Core's MoEAuxLossAutoScaler,
    whose scale Megatron's pipeline schedules set), so they train the router without changing the
    reported LM loss; their values are recorded for the step's metrics.
    """

    def __init__(self, cfg: MoEConfig, ep_comm: Optional[Comm] = None,
                 replica_comm: Optional[Comm] = None, init_method: Optional[Callable] = None,
                 output_init_method: Optional[Callable] = None):
        super().__init__()
        self.cfg = cfg
        self.ep_comm = ep_comm or SingleComm()
        self.replica_comm = replica_comm or SingleComm()
        cfg.check_expert_parallel(self.ep_comm.size)
        self.router = ROUTERS[cfg.router_type](cfg, init_method)
        self.dispatcher = DISPATCHERS[cfg.dispatcher](cfg.num_experts, self.ep_comm)
        # Experts on different expert-parallel ranks must start different: seed their init with
        # a draw from the default generator (identical on every rank) plus the rank.
        seed = int(torch.randint(0, 2**62, ()))
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed + self.ep_comm.rank)
            self.experts = GroupedExperts(cfg, cfg.num_experts // self.ep_comm.size, init_method,
                                          output_init_method)
        self.shared_experts = (SharedExpert(cfg, init_method, output_init_method)
                               if cfg.shared_expert_ffn_size else None)

    def set_layer_number(self, layer_number: int) -> None:
        """Called by Megatron's TransformerLayer with the global 1-based layer number."""
        self.router.layer_number = layer_number

    def forward(self, hidden_SBD: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """Returns (output [S, B, D], None) like Megatron's MLPs.

        padding_mask: optional bool [B, S], True at padding positions; those tokens are routed to
        no expert, excluded from balancing, and get only the shared expert's output.
        """
        S, B, D = hidden_SBD.shape
        x_TD = hidden_SBD.reshape(S * B, D)
        padding_T = None if padding_mask is None else padding_mask.t().reshape(-1)
        routing = self.router(x_TD, padding_T)
        losses = self.balance_losses(routing, S, B) if self.training else {}
        if self.cfg.capacity_factor is not None:
            routing = apply_capacity(routing, self.cfg.capacity_factor, self.cfg.drop_policy)
        self.router.record(routing, losses)
        # On CUDA the shared expert runs on a side stream, overlapping the dispatch.
        shared_TD = (start_on_side_stream(self.shared_experts, x_TD)
                     if self.shared_experts is not None else None)
        y_TD = self.routed_experts(x_TD, routing)
        if shared_TD is not None:
            y_TD = y_TD + join_side_stream(shared_TD)
        if losses:
            y_TD = MoEAuxLossAutoScaler.apply(y_TD, sum(self._weighted(losses).values()))
        return y_TD.view(S, B, D), None

    def routed_experts(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Dispatch, run the local experts, combine."""
        rows_ND, tokens_per_expert, state = self.dispatcher.dispatch(x_TD, routing)
        return self.dispatcher.combine(self.experts(rows_ND, tokens_per_expert), state)

    def balance_losses(self, routing: Routing, seq_len: int, batch: int) -> dict[str, torch.Tensor]:
        """Unweighted balance losses of this routing (before capacity drops)."""
        cfg, losses = self.cfg, {}
        if cfg.balancing == "aux_loss":
            counts_E = routing.selected_TE.sum(0, dtype=torch.float32)
            self.replica_comm.all_reduce(counts_E, op="sum")
            losses["aux_loss"] = switch_aux_loss(routing.probs_TE, routing.selected_TE, counts_E)
        elif cfg.balancing == "seq_aux_loss":
            losses["seq_aux_loss"] = sequence_aux_loss(routing.probs_TE, routing.selected_TE,
                                                       seq_len, batch)
        if cfg.z_loss_coeff > 0:
            losses["z_loss"] = z_loss(routing.logits_TE, routing.selected_TE)
        if cfg.router_type == "top_p" and cfg.entropy_loss_coeff > 0:
            losses["entropy_loss"] = entropy_loss(routing.probs_TE, routing.selected_TE)
        return losses

    def _weighted(self, losses: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        coeff = {"aux_loss": self.cfg.aux_loss_coeff, "seq_aux_loss": self.cfg.aux_loss_coeff,
                 "z_loss": self.cfg.z_loss_coeff, "entropy_loss": self.cfg.entropy_loss_coeff}
        return {name: coeff[name] * value for name, value in losses.items()}

