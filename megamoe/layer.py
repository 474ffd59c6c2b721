"""MoELayer: router -> dispatcher -> experts -> combine (+ shared expert).

Shape legend: S sequence, B micro-batch, D hidden, T = S * B tokens, E experts, N rows.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megamoe.balancing.erc import erc_loss
from megamoe.balancing.losses import (attach_loss, real_tokens, sequence_aux_loss,
                                     sequence_counts, switch_aux_loss, z_loss)
from megamoe.config import MoEConfig
from megamoe.dispatch import DISPATCHERS
from megamoe.errors import ConfigError
from megamoe.experts import GroupedExperts, SharedExpert
from megamoe.parallel.comm import Comm, SingleComm
from megamoe.parallel.overlap import join_side_stream, start_on_side_stream
from megamoe.routing import ROUTERS, Router, Routing, apply_capacity
from megamoe.routing.token_ids import layer_token_ids
from megamoe.routing.zero_experts import split_zero_experts


def latent_projections(cfg: MoEConfig, init_method: Optional[Callable],
                       output_init_method: Optional[Callable]) -> tuple[nn.Linear, nn.Linear]:
    """Latent MoE's down and up projections (`experts.latent_size`), replicated like the router,
    initialised as Megatron-Core's: the input and output init methods, zero biases."""
    D, L, bias = cfg.hidden_size, cfg.experts.latent_size, cfg.experts.bias
    down, up = nn.Linear(D, L, bias=bias), nn.Linear(L, D, bias=bias)
    default_init = lambda w: nn.init.normal_(w, 0.0, cfg.init_method_std)  # noqa: E731
    (init_method or default_init)(down.weight.data)
    (output_init_method or default_init)(up.weight.data)
    for projection in (down, up):
        if bias:
            nn.init.zeros_(projection.bias)
    return down, up


class MoELayer(nn.Module):
    """A Mixture-of-Experts MLP whose experts may be spread over an expert-parallel group.

    ep_comm: the expert-parallel group; this rank holds experts [rank*L, (rank+1)*L), L = E/size.
    replica_comm: every rank holding a replica of this router (data x context x tensor x expert
        parallel); the global aux loss counts assignments over it.
    token_comm: the ranks that split one micro-batch's tokens and sum the router's gradients
        (the tensor-parallel group under sequence parallelism); the balance losses are taken
        over all of their tokens (`megamoe.balancing.losses`).
    Balance losses are attached to the output's gradient (`attach_losses`), so they train the
    router without changing the reported LM loss; their values are recorded for the step's
    metrics. `balance_loss_scale` is their weight in the gradient: the weight the training loop
    gives this forward's main loss (e.g. 1/R when R data-parallel ranks average it). The layer
    is plain PyTorch: a host framework (Megatron-Core, `megamoe.megatron.moe_module`) adapts it
    through `make_router`, `start_counting`, `report`, `loss_scale` and `attach_losses`.
    """

    def __init__(self, cfg: MoEConfig, ep_comm: Optional[Comm] = None,
                 replica_comm: Optional[Comm] = None, init_method: Optional[Callable] = None,
                 output_init_method: Optional[Callable] = None, token_comm: Optional[Comm] = None):
        super().__init__()
        self.cfg = cfg
        self.ep_comm = ep_comm or SingleComm()
        self.replica_comm = replica_comm or SingleComm()
        self.token_comm = token_comm or SingleComm()
        self.balance_loss_scale = 1.0
        cfg.check_expert_parallel(self.ep_comm.size)
        self.router = self.make_router(cfg, init_method)
        if cfg.router.replay:
            self.router.replay = self.make_replay()
        self.router.group_comm = self.ep_comm
        self.router.token_comm = self.token_comm
        self.dispatcher = DISPATCHERS[cfg.dispatcher.kind](cfg.num_experts, self.ep_comm)
        # Experts on different expert-parallel ranks must start different: seed their init with
        # a draw from the default (CPU) generator, identical on every rank, plus the rank; on
        # the CPU also under a meta device context (the memory planner builds models there).
        seed = int(torch.randint(0, 2**62, (), device="cpu"))
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed + self.ep_comm.rank)
            self.experts = GroupedExperts(cfg, cfg.num_experts // self.ep_comm.size, init_method,
                                          output_init_method)
        self.shared_experts = (SharedExpert(cfg, init_method, output_init_method)
                               if cfg.shared_expert.ffn_hidden_size else None)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if cfg.experts.latent_size is not None:
            self.fc1_latent_proj, self.fc2_latent_proj = latent_projections(
                cfg, init_method, output_init_method)

    def make_router(self, cfg: MoEConfig, init_method: Optional[Callable]) -> Router:
        """The router of `cfg.router.kind`, from the `ROUTERS` registry."""
        return ROUTERS[cfg.router.kind](cfg, init_method)

    def make_replay(self):
        """Routing replay's state (`megamoe.routing.replay`): Megatron-Core's RouterReplay,
        which a host adapter supplies (`MegatronMoELayer`); refused here."""
        raise ConfigError("moe.router.replay records and replays routing through Megatron-Core's "
                          "RouterReplay; build the layer as megamoe.megatron.MegatronMoELayer "
                          "(or through megamoe's spec or trainer)")

    def set_layer_number(self, layer_number: int) -> None:
        """Called by Megatron's TransformerLayer with the global 1-based layer number."""
        self.router.layer_number = layer_number
        if self.router.replay is not None:
            self.router.replay.layer_number = layer_number

    def forward(self, hidden_SBD: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                token_ids: Optional[torch.Tensor] = None):
        """Returns (output [S, B, D], None) like Megatron's MLPs.

        padding_mask: optional bool [B, S], True at padding positions; those tokens are routed to
        no expert, excluded from balancing, and get only the shared expert's output.
        token_ids: optional [B, S], the batch's token ids for a router that chooses by them
        (hash routing); by default those the forward was run with
        (`megamoe.routing.token_ids`).
        """
        S, B, D = hidden_SBD.shape
        x_TD = hidden_SBD.reshape(S * B, D)
        padding_T = None if padding_mask is None else padding_mask.t().reshape(-1)
        counted = self.router.counts_this_forward()
        if counted:
            self.start_counting()
        if self.router.needs_token_ids:
            self.router.token_ids_T = layer_token_ids(S, B, self.token_comm, token_ids)
        routing = self.router(x_TD, padding_T)
        losses = self.balance_losses(routing, S, B, counted) if self.training else {}
        loss_scale = self.loss_scale(routing) if losses else 1.0
        # Zero-computation experts: the identity part of each token's routing.
        routing, identity_T1 = split_zero_experts(routing, self.cfg.num_experts)
        dispatcher = self.cfg.dispatcher
        if dispatcher.capacity_factor is not None:
            routing = apply_capacity(routing, dispatcher.capacity_factor, dispatcher.drop_policy)
        if counted:
            # Metrics hold each loss over the token group (this rank's share times its size).
            self.router.record(routing, {k: v * self.token_comm.size for k, v in losses.items()})
            self.report(routing, losses)
        elif not self.training and self.router.inference_tally is not None:
            self.router.inference_tally.record(routing.selected_TE, S, B)
        # On CUDA the shared expert runs on a side stream, overlapping the dispatch.
        shared_TD = (start_on_side_stream(self.shared_experts, x_TD)
                     if self.shared_experts is not None else None)
        y_TD = self.router.mix_output(x_TD, self.routed_experts(x_TD, routing), routing)
        if identity_T1 is not None:
            y_TD = y_TD + x_TD * identity_T1.to(x_TD.dtype)
        if shared_TD is not None:
            y_TD = y_TD + join_side_stream(shared_TD)
        if losses:
            total = sum(self._weighted(losses).values()) * loss_scale
            y_TD = self.attach_losses(y_TD, total)
        return y_TD.view(S, B, D), None

    def routed_experts(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Dispatch, run the local experts, combine; in latent width between the latent
        projections, when the layer has them."""
        if self.fc1_latent_proj is not None:
            x_TD = self.fc1_latent_proj(x_TD)
        rows_ND, tokens_per_expert, state = self.dispatcher.dispatch(x_TD, routing)
        y_TD = self.dispatcher.combine(self.experts(rows_ND, tokens_per_expert), state)
        if self.fc2_latent_proj is not None:
            y_TD = self.fc2_latent_proj(y_TD)
        return y_TD

    def loss_scale(self, routing: Routing) -> float | torch.Tensor:
        """Factor on the weighted balance losses before they are attached (1 here)."""
        return 1.0

    def attach_losses(self, y_TD: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """`y_TD` with the weighted balance losses attached to its gradient, with weight
        `balance_loss_scale`."""
        return attach_loss(y_TD, total, self.balance_loss_scale)

    def start_counting(self) -> None:
        """Before a counted forward (nothing here: `step_balancing` ends each step; a host
        loop that never calls it tells step boundaries in its adapter)."""

    def report(self, routing: Routing, losses: dict[str, torch.Tensor]) -> None:
        """After a counted forward: hand its statistics to a host training loop's logging
        (nothing here; Megatron's tracker in `MegatronMoELayer`)."""

    def balance_losses(self, routing: Routing, seq_len: int, batch: int,
                       counted: bool = True) -> dict[str, torch.Tensor]:
        """Unweighted balance losses of this routing (before capacity drops), each this rank's
        share of the loss over the token group (`megamoe.balancing.losses`). `counted`: this
        forward adds to the step's running global counts (False in recomputation)."""
        cfg, losses = self.cfg.balancing, {}
        weights = cfg.loss_coeffs
        wants_z = cfg.z_loss_coeff > 0
        wants_own = bool(self.router.loss_coeffs())
        if cfg.erc_loss_coeff > 0:
            losses["erc_loss"] = erc_loss(self.router.weight, self.experts.fc1_weight,
                                          cfg.erc_noise, cfg.erc_margin, self.ep_comm)
        if not (weights or wants_z or wants_own):
            return losses
        selected_TE = routing.selected_TE
        E = selected_TE.shape[1]
        # Assignments per expert and routed tokens, over the token group: one all-reduce.
        group_E1 = torch.cat([selected_TE.sum(0, dtype=torch.float32),
                              real_tokens(selected_TE).sum(dtype=torch.float32).reshape(1)])
        self.token_comm.all_reduce(group_E1, op="sum")
        counts_E, num_tokens = group_E1[:E], group_E1[E]
        for name in ("aux_loss", "adaptive_aux_loss"):
            if name in weights:
                losses[name] = switch_aux_loss(routing.probs_TE, selected_TE, counts_E,
                                               num_tokens)
        if "global_aux_loss" in weights:
            replica_E = selected_TE.sum(0, dtype=torch.float32)
            self.replica_comm.all_reduce(replica_E, op="sum")
            load = self.router.load
            mean_E = load.mean_global_counts(replica_E) if counted or load.global_counts_E is None \
                else load.global_counts_E / load.global_microbatches
            losses["global_aux_loss"] = switch_aux_loss(routing.probs_TE, selected_TE, mean_E,
                                                        num_tokens)
        if "seq_aux_loss" in weights:
            per_sequence = sequence_counts(selected_TE, seq_len, batch)
            self.token_comm.all_reduce(per_sequence, op="sum")
            losses["seq_aux_loss"] = sequence_aux_loss(routing.probs_TE, selected_TE, seq_len,
                                                       batch, per_sequence)
        if wants_z:
            losses["z_loss"] = z_loss(routing.logits_TE, selected_TE, num_tokens)
        losses.update(self.router.own_losses(routing, num_tokens))
        return losses

    def _weighted(self, losses: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        balancing = self.cfg.balancing
        coeff = {**balancing.loss_coeffs, "z_loss": balancing.z_loss_coeff,
                 "erc_loss": balancing.erc_loss_coeff, **self.router.loss_coeffs()}
        if balancing.uses_adaptive_aux:
            coeff["adaptive_aux_loss"] = self.router.adaptive_aux_coeff[0]
        return {name: coeff[name] * value for name, value in losses.items()}
