"""The megamoe layer as Megatron-Core builds its `mlp` slot.

TransformerLayer builds the mlp module with `config` (0.16) or `config, pg_collection,
is_mtp_layer, name` (0.19), plus the spec's `params`. `MegatronMoELayer` accepts both and is
configured by the spec's `moe`, the MoEConfig object itself (mapped once from Megatron-LM's
`--moe-*` flags when the spec was made without one: `moe_config_from_transformer_config`); it
takes its process groups from the pg_collection (or Megatron's parallel_state). Its
`sharded_state_dict` writes Megatron-Core's own MoE checkpoint layout with experts keyed by
global id (`megamoe.megatron.sharded_state`).

Who ends each step's balancing is the spec's `step_owner` (`megamoe.balancing.owner`): megamoe's
trainer passes `STEP_BALANCING`; under Megatron-LM's training loop (no owner in the spec) its
`finalize_model_grads` updates the expert biases when `moe_router_enable_expert_bias` is on
(`megamoe.megatron.router_counts`) and the layer itself applies the rest of a step's balancing
(the bias too without that flag, expert thresholds, the adaptive aux coefficient) at the next
step's first forward. Megatron-LM's logging shows the balance losses and load metrics
(`megamoe.megatron.tracker`), and under sequence parallelism the balance losses are taken over
the whole tensor-parallel group's tokens, so they train the router exactly as at TP=1.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_default_pg_collection

from megamoe.balancing import step_balancing
from megamoe.balancing.owner import StepOwner
from megamoe.config import MoEConfig
from megamoe.errors import ConfigError
from megamoe.layer import MoELayer
from megamoe.megatron.compat import global_layer_number
from megamoe.megatron.fields import (QUANTILE_BALANCING, check_megatron_fields,
                                    moe_config_from_transformer_config)
from megamoe.megatron.router_counts import megatron_router
from megamoe.megatron.sharded_state import drop_extra_state_placeholders, moe_sharded_state_dict
from megamoe.megatron.tracker import CLOCK, report_load_metrics, save_layer_statistics
from megamoe.parallel.comm import SingleComm, as_comm
from megamoe.routing import ROUTERS, Routing

# Counted forwards after which a step that never ended is reported: more micro-batches than any
# gradient-accumulation step runs.
MAX_FORWARDS_PER_STEP = 4096


class MegatronMoELayer(MoELayer):
    """MoELayer for a Megatron-Core TransformerLayer's `mlp` slot.

    moe: the layer's MoEConfig, used as is (None: the one the TransformerConfig's MoE settings
        say, as for Megatron-LM's `--moe-*` flags).
    bias_width: width of the expert-bias buffers (the widest router of the model).
    step_owner: who ends each step's balancing (`megamoe.balancing.owner`); None: Megatron-LM's
        loop, `megatron_lm_owner(config)`.
    """

    def __init__(self, config: Any, submodules: Any = None, layer_number: Optional[int] = None,
                 pg_collection: Any = None, is_mtp_layer: bool = False, name: Optional[str] = None,
                 moe: Optional[MoEConfig] = None, bias_width: Optional[int] = None,
                 step_owner: Optional[StepOwner] = None):
        if moe is None:
            cfg = moe_config_from_transformer_config(config)  # checks Megatron's fields too
        else:
            # Megatron settings megamoe cannot honour are refused whatever made the object (a
            # spec function may have mapped it from Megatron-LM's config wrapper, not this one).
            check_megatron_fields(config)
            cfg = moe
        if cfg.hidden_size != config.hidden_size:
            raise ConfigError(f"the spec's MoEConfig has hidden_size={cfg.hidden_size} but the "
                              f"model's is {config.hidden_size}; build it with the model's width")
        pgs = pg_collection if pg_collection is not None else get_default_pg_collection()
        _check_supported_parallelism(config, pgs)
        owner = step_owner or megatron_lm_owner(config)
        _check_bias_owner(config, cfg, owner)
        _check_token_ids_survive_recompute(config, cfg)
        tp = pgs.tp.size() if pgs.tp is not None else 1
        self._bias_width = bias_width
        self._step_owner = owner
        self._is_mtp_layer = is_mtp_layer
        super().__init__(cfg, ep_comm=as_comm(pgs.ep), replica_comm=as_comm(pgs.tp_dp_cp),
                         init_method=config.init_method,
                         output_init_method=config.output_layer_init_method,
                         token_comm=as_comm(pgs.tp) if tp > 1 else SingleComm())
        self._generation = CLOCK.tick()
        self._warned_no_step = False
        report_load_metrics()
        self.config = config
        self.pg_collection = pgs
        if layer_number is not None:
            self.set_layer_number(layer_number)
        self.register_load_state_dict_pre_hook(drop_extra_state_placeholders)
        if config.sequence_parallel:
            # Each tensor-parallel rank routes its own tokens through replicated router,
            # shared-expert and latent-projection weights: Megatron's finalize_model_grads sums
            # the gradients of parameters marked this way over the tensor-parallel group.
            replicated = (self.router, self.shared_experts, self.fc1_latent_proj,
                          self.fc2_latent_proj)
            for module in replicated:
                for param in module.parameters() if module is not None else ():
                    param.sequence_parallel = True

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's layer number made global: a multi-token-prediction depth's layer comes
        after the decoder's (`compat.global_layer_number`), so its metrics, seeds and tracker
        entries are its own."""
        super().set_layer_number(global_layer_number(layer_number, self.config,
                                                     self._is_mtp_layer))

    def forward(self, hidden_SBD, padding_mask=None, token_ids=None):
        """The MoE layer; recomputed in the backward pass under Megatron-Core's selective
        recompute of `moe` (with `mlp`, TransformerLayer already recomputes this whole slot).
        The router counts only the kept forward (`Router.counts_this_forward`)."""
        modules = getattr(self.config, "recompute_modules", None) or ()
        if (self.training and self.config.recompute_granularity == "selective"
                and "moe" in modules and "mlp" not in modules):
            return tensor_parallel.checkpoint(
                functools.partial(super().forward, padding_mask=padding_mask,
                                  token_ids=token_ids), False, hidden_SBD)
        return super().forward(hidden_SBD, padding_mask, token_ids)

    def make_router(self, cfg: MoEConfig, init_method):
        """The configured router, ended by this layer's step owner, with Megatron's bias-update
        contract when that is finalize_model_grads (`megamoe.megatron.router_counts`)."""
        return megatron_router(ROUTERS[cfg.router.kind])(cfg, init_method, self._bias_width,
                                                         self._step_owner)

    def make_replay(self):
        """Megatron-Core's own RouterReplay (registered in its global list as the layer is
        built, so in layer order), with the `layer_number` megatron-core 0.19 gives it."""
        return megatron_router_replay()

    def attach_losses(self, y_TD, total):
        """Megatron-Core's MoEAuxLossAutoScaler, whose scale Megatron's pipeline schedules set
        (in place of `balance_loss_scale`)."""
        return MoEAuxLossAutoScaler.apply(y_TD, total)

    def start_counting(self) -> None:
        """Under Megatron-LM's loop (a step owner that ends steps in the forward), end the last
        step at this step's first forward. That loop calls no megamoe hook between steps; the
        one per-iteration event every layer can see, those without an expert bias included, is
        its logging reducing and zeroing Megatron's MoE tracker (`CLOCK`,
        `megamoe.megatron.tracker`), so that is the step boundary. What the owner leaves to the
        layer (expert thresholds, the adaptive aux coefficient, a bias finalize_model_grads
        does not update) is applied here by `step_balancing`, from the last step's counts
        reduced over the router's replicas: the values this forward sees are those
        `step_balancing` would have set at the end of the last step."""
        if not self._step_owner.step_ends_in_forward:
            return
        generation = CLOCK.tick()
        if generation != self._generation:
            self._generation = generation
            if self.router.step_pending():
                step_balancing(self, self.replica_comm)
            self.router.load.reset()
        elif self.training:
            self._warn_if_no_step_ends()

    def _warn_if_no_step_ends(self) -> None:
        """Say once, never silently, that this layer's step has not ended in
        MAX_FORWARDS_PER_STEP counted forwards: nothing in the loop ends its steps (a loop of
        one's own, with neither Megatron's MoE logging nor `step_balancing`), so its balancing
        state (expert bias, thresholds, ...) does not move."""
        stats = self.router.load.stats
        if self._warned_no_step or stats is None or \
                int(stats.microbatches) < MAX_FORWARDS_PER_STEP:
            return
        self._warned_no_step = True
        warnings.warn(f"MoE layer {self.router.layer_number}: {MAX_FORWARDS_PER_STEP} forwards "
                      f"without the end of a step (step owner {self._step_owner.value}, which "
                      "ends it at Megatron's MoE logging); its balancing does not move. Call "
                      "megamoe.balancing.step_balancing(model) after each optimizer step",
                      stacklevel=2)

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


def megatron_router_replay():
    """A new Megatron-Core RouterReplay (`megamoe.routing.replay` drives a router with it)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    replay = RouterReplay()
    replay.layer_number = None
    return replay


def megatron_lm_owner(config: Any) -> StepOwner:
    """Who ends a step under Megatron-LM's training loop: its finalize_model_grads updates the
    expert biases when `moe_router_enable_expert_bias` is on, and quantile balancing's when the
    load-balancing type is `quantile_balancing` (megatron-core 0.19); the layer's next forward
    does the rest. Otherwise the layer's next forward does it all."""
    if config.moe_router_enable_expert_bias or megatron_runs_quantile_balancing(config):
        return StepOwner.FINALIZE_MODEL_GRADS
    return StepOwner.NEXT_FORWARD


def megatron_runs_quantile_balancing(config: Any) -> bool:
    """Megatron-Core's finalize_model_grads updates quantile balancing's biases: its type is
    `quantile_balancing` and this megatron-core has it (0.19 has its EMA field; 0.16 does not)."""
    return (config.moe_router_load_balancing_type == QUANTILE_BALANCING
            and hasattr(config, "moe_router_quantile_balancing_ema"))


def _check_bias_owner(config: Any, cfg: MoEConfig, owner: StepOwner) -> None:
    """The bias is updated once, by its owner: Megatron's finalize_model_grads updates every bias
    router when `moe_router_enable_expert_bias` is on, with its own rate and rule; refuse a
    layer whose settings it would silently replace, or whose owner is someone else."""
    balancing = cfg.balancing
    if balancing.uses_quantile:
        _check_quantile_owner(config, balancing, owner)
    if not balancing.uses_expert_bias:
        return
    by_megatron = owner is StepOwner.FINALIZE_MODEL_GRADS
    if by_megatron != bool(config.moe_router_enable_expert_bias):
        raise ConfigError(
            f"moe_router_enable_expert_bias={config.moe_router_enable_expert_bias} but the expert "
            f"biases are updated by {owner.value}; turn the flag on exactly when Megatron's "
            "finalize_model_grads is the one to update them")
    if not by_megatron:
        return
    if cfg.experts.zero_experts:
        raise ConfigError(
            f"experts.zero_experts={cfg.experts.zero_experts} with moe_router_enable_expert_bias: "
            "Megatron's finalize_model_grads would balance identity and real experts alike "
            "instead of steering the compute budget; train with megamoe's trainer (or call "
            "megamoe.balancing.step_balancing) and leave the flag off")
    if balancing.bias_update_schedule:
        raise ConfigError(
            f"balancing.bias_update_schedule={balancing.bias_update_schedule}: Megatron's "
            "finalize_model_grads updates the biases at moe_router_bias_update_rate every step; "
            "drop the schedule (or train with megamoe's trainer)")
    if (balancing.bias_update_rate != config.moe_router_bias_update_rate
            or balancing.bias_mean_centering):
        raise ConfigError(
            f"balancing.bias_update_rate={balancing.bias_update_rate}, "
            f"balancing.bias_mean_centering={balancing.bias_mean_centering}: with "
            "moe_router_enable_expert_bias Megatron's finalize_model_grads updates every bias at "
            f"moe_router_bias_update_rate={config.moe_router_bias_update_rate} without centering; "
            "set the layer to match"
        )


def _check_quantile_owner(config: Any, balancing: Any, owner: StepOwner) -> None:
    """A quantile-balanced layer whose bias finalize_model_grads updates needs Megatron to run
    quantile balancing, with the layer's EMA."""
    if owner is not StepOwner.FINALIZE_MODEL_GRADS:
        return
    if not megatron_runs_quantile_balancing(config):
        raise ConfigError(
            f"balancing.methods=quantile in a layer whose biases Megatron's finalize_model_grads "
            f"updates, with moe_router_load_balancing_type="
            f"{config.moe_router_load_balancing_type!r}: it updates quantile biases only under "
            f"{QUANTILE_BALANCING!r} (megatron-core 0.19); set that type for the model")
    if balancing.quantile_ema != config.moe_router_quantile_balancing_ema:
        raise ConfigError(
            f"balancing.quantile_ema={balancing.quantile_ema}: Megatron's finalize_model_grads "
            "blends quantile biases with moe_router_quantile_balancing_ema="
            f"{config.moe_router_quantile_balancing_ema}; set the layer to match")


def _check_token_ids_survive_recompute(config: Any, cfg: MoEConfig) -> None:
    """A hash layer reads its forward's token ids (`megamoe.routing.token_ids`), which are gone
    when the backward recomputes it."""
    modules = set(getattr(config, "recompute_modules", None) or ())
    recomputed = config.recompute_granularity == "full" or (
        config.recompute_granularity == "selective" and modules & {"mlp", "moe"})
    if cfg.router.kind == "hash" and recomputed:
        raise ConfigError(
            f"router.kind=hash with recompute_granularity={config.recompute_granularity!r}: a "
            "recomputed MoE layer runs after its forward's token ids are gone; recompute other "
            "modules (not mlp or moe) or none")


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
