"""The megamoe layer as Megatron-Core builds its `mlp` slot.

TransformerLayer builds the mlp module with `config` (0.16) or `config, pg_collection,
is_mtp_layer, name` (0.19), plus the spec's `params`. `MegatronMoELayer` accepts both, reads the
user's `moe_*` settings from the TransformerConfig (`moe_config_from_transformer_config`) with the
spec's `moe` overrides on top, and takes its process groups from the pg_collection (or
Megatron's parallel_state). Its `sharded_state_dict` writes Megatron-Core's own MoE checkpoint
layout with experts keyed by global id (`megamoe.megatron.sharded_state`).

Under Megatron-LM's training loop: its `finalize_model_grads` updates the expert biases (see
`megamoe.routing.Router`), its logging shows the balance losses and load metrics
(`megamoe.megatron.tracker`), the layer itself applies the rest of a step's balancing (expert
thresholds, the adaptive aux coefficient) at the next step's first forward, and under sequence
parallelism the balance losses are taken over the whole tensor-parallel group's tokens, so they
train the router exactly as at TP=1.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_default_pg_collection

from megamoe.balancing import step_balancing
from megamoe.config import MoEConfig
from megamoe.errors import ConfigError
from megamoe.layer import MoELayer
from megamoe.megatron.fields import moe_config_from_transformer_config
from megamoe.megatron.router_counts import megatron_router
from megamoe.megatron.sharded_state import drop_extra_state_placeholders, moe_sharded_state_dict
from megamoe.megatron.tracker import CLOCK, report_load_metrics, save_layer_statistics
from megamoe.parallel.comm import SingleComm, as_comm
from megamoe.routing import ROUTERS, Routing


class MegatronMoELayer(MoELayer):
    """MoELayer for a Megatron-Core TransformerLayer's `mlp` slot.

    moe: MoEConfig fields that override (or add to) what the TransformerConfig says, e.g.
        {"router_type": "top_p"} or a per-layer {"num_experts": 16}.
    bias_width: width of the expert-bias buffers (the widest router of the model).
    """

    def __init__(self, config: Any, submodules: Any = None, layer_number: Optional[int] = None,
                 pg_collection: Any = None, is_mtp_layer: bool = False, name: Optional[str] = None,
                 moe: Optional[dict] = None, bias_width: Optional[int] = None):
        cfg = moe_config_from_transformer_config(config, **(moe or {}))
        pgs = pg_collection if pg_collection is not None else get_default_pg_collection()
        _check_supported_parallelism(config, pgs)
        _check_megatron_bias_update(config, cfg)
        tp = pgs.tp.size() if pgs.tp is not None else 1
        self._bias_width = bias_width
        super().__init__(cfg, ep_comm=as_comm(pgs.ep), replica_comm=as_comm(pgs.tp_dp_cp),
                         init_method=config.init_method,
                         output_init_method=config.output_layer_init_method,
                         token_comm=as_comm(pgs.tp) if tp > 1 else SingleComm())
        self._generation = CLOCK.tick()
        report_load_metrics()
        self.config = config
        self.pg_collection = pgs
        if layer_number is not None:
            self.set_layer_number(layer_number)
        self.register_load_state_dict_pre_hook(drop_extra_state_placeholders)
        if config.sequence_parallel:
            # Each tensor-parallel rank routes its own tokens through replicated router and
            # shared-expert weights: Megatron's finalize_model_grads sums the gradients of
            # parameters marked this way over the tensor-parallel group.
            shared = self.shared_experts.parameters() if self.shared_experts is not None else ()
            for param in (*self.router.parameters(), *shared):
                param.sequence_parallel = True

    def forward(self, hidden_SBD, padding_mask=None):
        """The MoE layer; recomputed in the backward pass under Megatron-Core's selective
        recompute of `moe` (with `mlp`, TransformerLayer already recomputes this whole slot).
        The router counts only the kept forward (`Router.counts_this_forward`)."""
        modules = getattr(self.config, "recompute_modules", None) or ()
        if (self.training and self.config.recompute_granularity == "selective"
                and "moe" in modules and "mlp" not in modules):
            return tensor_parallel.checkpoint(
                functools.partial(super().forward, padding_mask=padding_mask), False, hidden_SBD)
        return super().forward(hidden_SBD, padding_mask)

    def make_router(self, cfg: MoEConfig, init_method):
        """The configured router with Megatron's bias-update contract
        (`megamoe.megatron.router_counts`)."""
        return megatron_router(ROUTERS[cfg.router_type])(cfg, init_method, self._bias_width)

    def attach_losses(self, y_TD, total):
        """Megatron-Core's MoEAuxLossAutoScaler, whose scale Megatron's pipeline schedules set
        (in place of `balance_loss_scale`)."""
        return MoEAuxLossAutoScaler.apply(y_TD, total)

    def start_counting(self) -> None:
        """A new step begins when Megatron's finalize_model_grads consumed the routing counts
        (`bias_updated_by_host`) or when Megatron-LM's logging zeroed its MoE tracker. Megatron-LM's
        loop never calls `step_balancing`, so what only it applies (expert thresholds, the
        adaptive aux coefficient, a bias Megatron does not update) is applied here, from the
        last step's counts reduced over the router's replicas: the values the next forward sees
        are those `step_balancing` would have set."""
        generation = CLOCK.tick()
        if generation != self._generation:
            self._generation = generation
            if self.router.step_pending():
                step_balancing(self, self.replica_comm)
            self.router.load.reset()
        elif self.router.bias_updated_by_host:
            self.router.load.reset()

    def loss_scale(self, routing: Routing):
        """With `calculate_per_token_loss` Megatron divides every gradient by the step's token
        count instead of averaging per micro-batch; like its router, scale the balance losses by
        this rank's routed tokens so they keep their weight."""
        if getattr(self.config, "calculate_per_token_loss", False):
            return routing.selected_TE.any(-1).sum()
        return 1.0

    def report(self, routing: Routing, losses: dict) -> None:
        """Balance losses and load metrics into Megatron-Core's MoE logging tracker."""
        num_layers = self.config.num_layers + (getattr(self.config, "mtp_num_layers", 0) or 0)
        group = self.pg_collection.tp if self.token_comm.size > 1 else None
        save_layer_statistics(losses, routing.selected_TE, self.router.layer_number, num_layers,
                              token_group=group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Megatron-Core's MoE checkpoint layout (experts on a global expert axis), called by
        TransformerLayer with the layer's prefix and offsets."""
        return moe_sharded_state_dict(self, prefix, sharded_offsets, metadata)


def _check_megatron_bias_update(config: Any, cfg: MoEConfig) -> None:
    """Megatron's finalize_model_grads applies its own rate and rule to every bias router when
    `moe_router_enable_expert_bias` is on; refuse per-layer settings it would silently replace."""
    if not (config.moe_router_enable_expert_bias and cfg.uses_expert_bias):
        return
    if cfg.bias_update_rate != config.moe_router_bias_update_rate or cfg.bias_mean_centering:
        raise ConfigError(
            f"bias_update_rate={cfg.bias_update_rate}, bias_mean_centering="
            f"{cfg.bias_mean_centering}: with moe_router_enable_expert_bias Megatron's "
            "finalize_model_grads updates every bias at moe_router_bias_update_rate="
            f"{config.moe_router_bias_update_rate} without centering; set the layer to match"
        )


def _check_supported_parallelism(config: Any, pgs: Any) -> None:
    expert_tp = pgs.expt_tp.size() if pgs.expt_tp is not None else 1
    if expert_tp > 1:
        raise ConfigError(
            f"expert_tensor_parallel_size={expert_tp}: megamoe experts are not tensor-parallel; "
            "set expert_tensor_parallel_size=1 and use expert parallelism instead"
        )
    tp = pgs.tp.size() if pgs.tp is not None else 1
    if tp > 1 and not config.sequence_parallel:
        raise ConfigError(
            f"tensor_model_parallel_size={tp} without sequence_parallel: megamoe needs each "
            "tensor-parallel rank to hold its own tokens; set sequence_parallel=True"
        )
