"""What megamoe does with every `moe_*` field of Megatron-Core's TransformerConfig.

Each field is in exactly one class:
- HONOURED: mapped onto the MoEConfig tree by `LINKS` (the one table, read both ways:
  `moe_config_from_transformer_config` and `transformer_config_settings`), read by the specs
  (`moe_layer_freq`) or by Megatron's own training loop around megamoe layers (logging, the
  aux-loss scale).
- NO_EFFECT: kernel, fusion, overlap or flex-dispatcher tuning; megamoe computes the same
  function with its own kernels, so any value is accepted.
- REFUSED: a behaviour megamoe does not implement; any value but the field's default raises a
  ConfigError naming the field and what to do.
A `moe_*` field that is in none of them (added by a newer megatron-core) is refused unless it
holds its default, so a new Megatron setting is never silently dropped.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.transformer_config import TransformerConfig

from megamoe.balancing.owner import StepOwner
from megamoe.config import (BALANCE_LOSSES, BIAS, GATED_ACTIVATIONS, QUANTILE, BalancingConfig,
                            MoEConfig)
from megamoe.errors import ConfigError
from megamoe.registry import DISPATCHERS
from megamoe.settings import deep_merge

NO_EFFECT = frozenset({
    "moe_grouped_gemm", "moe_use_legacy_grouped_gemm", "moe_permute_fusion", "moe_router_fusion",
    "moe_shared_expert_overlap",
    # Only read by the flex dispatcher, which is refused below.
    "moe_flex_dispatcher_backend", "moe_deepep_num_sms", "moe_hybridep_num_sms",
    "moe_flex_dispatcher_num_sms", "moe_hybridep_num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute", "moe_hybridep_num_sms_preprocessing",
    "moe_hybridep_pad_uneven_dispatch_inputs", "moe_ncclep_static_shape", "moe_ncclep_zero_copy",
    "moe_permute_fusion_into_hybridep",
    # Only read when moe_paged_stash (refused) is on.
    "moe_paged_stash_buffer_size_factor_cpu", "moe_paged_stash_buffer_size_factor_cuda",
    "moe_paged_stash_page_size",
})

_OFF = "turn it off"
REFUSED: dict[str, str] = {
    "moe_extended_tp": "megamoe experts are not tensor-parallel; turn it off and use expert "
                       "parallelism",
    "moe_router_topk_limited_devices": "use group-limited routing instead: "
                                       "--moe-router-num-groups and --moe-router-group-topk",
    "moe_router_padding_for_quantization": f"megamoe does not pad the routing map for FP8; {_OFF}",
    "moe_router_padding_for_fp8": f"megamoe does not pad the routing map for FP8; {_OFF}",
    "moe_router_force_load_balancing": f"megamoe has no benchmark-only random routing; {_OFF}",
    "moe_token_dropping": "use --moe-expert-capacity-factor for token dropping",
    "moe_enable_deepep": "megamoe dispatches with 'alltoall' or 'allgather'; turn DeepEP off",
    "moe_pad_expert_input_to_capacity": f"megamoe never pads expert inputs to capacity; {_OFF}",
    "moe_apply_probs_on_input": f"megamoe applies the gates to the expert outputs; {_OFF}",
    "moe_expert_rank_capacity_factor": "use --moe-expert-capacity-factor (per expert) instead",
    "moe_mlp_glu_interleave_size": "megamoe stores GLU halves un-interleaved; leave it unset",
    "moe_shared_expert_glu_interleave_size": "megamoe stores GLU halves un-interleaved; leave it "
                                             "unset",
    "moe_pad_experts_for_cuda_graph_inference": f"megamoe does not capture CUDA graphs; {_OFF}",
    "moe_paged_stash": f"megamoe does not stash expert activations; {_OFF}",
    "moe_router_force_biased": f"megamoe has no forced-bias routing; {_OFF}",
    "moe_single_grouped_bias": f"megamoe always stacks expert biases; {_OFF}",
    "moe_single_grouped_weight": f"megamoe always stacks expert weights; {_OFF}",
}


def classify(name: str) -> str:
    """'honoured', 'no_effect', 'refused' or 'unknown' for a TransformerConfig field name."""
    if name in HONOURED:
        return "honoured"
    if name in NO_EFFECT:
        return "no_effect"
    if name in REFUSED:
        return "refused"
    return "unknown"


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def check_megatron_fields(tc: Any) -> None:
    """Raise ConfigError for the first Megatron MoE setting megamoe would otherwise drop: a
    refused or unknown `moe_*` field away from its default, or the flex dispatcher."""
    if getattr(tc, "moe_token_dispatcher_type", "alltoall") not in DISPATCHERS:
        raise ConfigError(
            f"moe_token_dispatcher_type={tc.moe_token_dispatcher_type!r} is not supported by "
            f"megamoe; use one of {list(DISPATCHERS.names())}"
        )
    fields = dataclasses.fields(tc) if dataclasses.is_dataclass(tc) else ()
    for field in fields:
        kind = classify(field.name) if field.name.startswith("moe_") else "honoured"
        if kind in ("honoured", "no_effect"):
            continue
        default, value = _default(field), getattr(tc, field.name)
        if default is dataclasses.MISSING or value == default or (value is None and not default):
            continue
        if kind == "refused":
            raise ConfigError(f"{field.name}={value!r} is not supported by megamoe: "
                              f"{REFUSED[field.name]}")
        raise ConfigError(
            f"{field.name}={value!r} is a Megatron-Core setting megamoe does not know (newer "
            "megatron-core?); leave it at its default or use a megamoe release that supports it"
        )


@dataclasses.dataclass(frozen=True)
class Link:
    """Megatron-Core TransformerConfig fields <-> places in the MoEConfig tree.

    to_tree(*megatron values) -> {tree path: value} (a path left out keeps MoEConfig's default);
    to_megatron(*tree values) -> {field: value}. `host`: Megatron-Core itself acts on the field
    in a model whose MoE layers are megamoe's (the layer pattern, the optimizer and checkpoint
    layout, the expert-bias update and global aux-loss reset of finalize_model_grads), so a
    TransformerConfig written from an MoEConfig carries it; the other fields configure only
    Megatron's own router, dispatcher and experts, which such a model never builds."""

    megatron: tuple[str, ...]
    tree: tuple[str, ...]
    to_tree: Callable[..., dict]
    to_megatron: Callable[..., dict]
    host: bool = False


def _same(megatron: str, path: str, host: bool = False, off: Any = None) -> Link:
    """A field holding the tree's value as is; `off`: the tree's value for Megatron's None."""
    def to_tree(value: Any) -> dict:
        return {path: off if value is None else value}

    def to_megatron(value: Any) -> dict:
        return {megatron: None if off is not None and value == off else value}

    return Link((megatron,), (path,), to_tree, to_megatron, host)


QUANTILE_BALANCING = "quantile_balancing"
"""Megatron-Core's name for quantile balancing (`balancing.methods: quantile`)."""


def _balancing_to_tree(kinds: Any, coeffs: Any, expert_bias: bool) -> dict:
    """balancing.methods and aux_loss_coeff from Megatron's load-balancing type(s),
    coefficient(s) and expert-bias flag. A loss whose coefficient is 0 is off, as in Megatron's
    router; `moe_router_enable_expert_bias` adds `bias`. Megatron's router runs
    `quantile_balancing` only as the one type, without an aux-loss coefficient or the expert
    bias; anything else with it is refused."""
    if kinds == QUANTILE_BALANCING or kinds == [QUANTILE_BALANCING]:
        if any(c != 0 for c in (coeffs if isinstance(coeffs, (list, tuple)) else [coeffs])) \
                or expert_bias:
            raise ConfigError(
                f"moe_router_load_balancing_type={QUANTILE_BALANCING!r} with moe_aux_loss_coeff="
                f"{coeffs}, moe_router_enable_expert_bias={expert_bias}: quantile balancing sets "
                "the load by its own bias alone; set --moe-aux-loss-coeff 0 and drop "
                "--moe-router-enable-expert-bias")
        return {"balancing.methods": QUANTILE}
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    if len(coeffs) != len(kinds):
        raise ConfigError(
            f"moe_aux_loss_coeff={coeffs} has {len(coeffs)} values for "
            f"moe_router_load_balancing_type={kinds}; give one coefficient per type"
        )
    methods, weights = [], []
    for kind, coeff in zip(kinds, coeffs):
        if kind == "none":
            continue
        if kind not in BALANCE_LOSSES:
            alone = (" (alone, as Megatron-Core's router runs it)"
                     if kind == QUANTILE_BALANCING else "")
            raise ConfigError(
                f"moe_router_load_balancing_type={kind!r} is not supported by megamoe; use "
                f"{list(BALANCE_LOSSES) + ['none']} and/or --moe-router-enable-expert-bias, or "
                f"{QUANTILE_BALANCING!r}{alone}"
            )
        if coeff > 0:
            methods.append(kind)
            weights.append(float(coeff))
    if expert_bias:
        methods.insert(0, BIAS)
    methods = methods or ["none"]
    tree: dict[str, Any] = {"balancing.methods": methods[0] if len(methods) == 1 else methods}
    if weights:  # else MoEConfig's default weight, for losses an override turns on
        tree["balancing.aux_loss_coeff"] = weights[0] if len(weights) == 1 else weights
    return tree


def _balancing_to_megatron(methods: Any, coeffs: Any) -> dict:
    """Megatron's load-balancing types (one list, one coefficient each, or quantile balancing's
    one name) and expert-bias flag."""
    settings = BalancingConfig(methods=methods, aux_loss_coeff=coeffs)
    if settings.uses_quantile:
        return {"moe_router_load_balancing_type": QUANTILE_BALANCING, "moe_aux_loss_coeff": 0.0,
                "moe_router_enable_expert_bias": False}
    weights = settings.loss_coeffs
    return {"moe_router_load_balancing_type": list(weights) or ["none"],
            "moe_aux_loss_coeff": list(weights.values()) or [0.0],
            "moe_router_enable_expert_bias": settings.uses_expert_bias}


def _quantile_ema_to_tree(ema: Optional[float]) -> dict:
    """balancing.quantile_ema (megatron-core 0.16, which has no quantile balancing, lacks the
    field: None here, the tree's default)."""
    return {} if ema is None else {"balancing.quantile_ema": ema}


def _activation_to_tree(function: Any, gated: bool, offset: float,
                        clamp: Optional[float]) -> dict:
    """experts.activation (and swiglu_limit) from Megatron's activation function, GLU flag, GLU
    linear offset and clamp value. GPT-OSS's clamped SwiGLU is Megatron's gated quick_gelu with
    offset 1 and a clamp."""
    name = getattr(function, "__name__", str(function))
    if gated:
        if function is F.silu and offset == 0.0:
            return {"experts.activation": "swiglu"}
        if function is quick_gelu and offset == 1.0 and clamp is not None:
            return {"experts.activation": "clamped_swiglu", "experts.swiglu_limit": clamp}
        raise ConfigError(
            f"gated activation {name!r} with glu_linear_offset={offset}, "
            f"activation_func_clamp_value={clamp} is not supported; use activation_func=F.silu "
            "(swiglu) or quick_gelu with glu_linear_offset=1.0 and a clamp value "
            "(clamped_swiglu)"
        )
    if function is F.gelu:
        return {"experts.activation": "gelu"}
    if "squared_relu" in name:
        return {"experts.activation": "squared_relu"}
    raise ConfigError(
        f"activation {name!r} is not supported; use swiglu (gated silu), gelu or squared_relu"
    )


def _activation_to_megatron(activation: str, limit: float) -> dict:
    function = {"swiglu": F.silu, "clamped_swiglu": quick_gelu, "gelu": F.gelu,
                "squared_relu": squared_relu}[activation]
    clamped = activation == "clamped_swiglu"
    return {"activation_func": function, "gated_linear_unit": activation in GATED_ACTIVATIONS,
            "glu_linear_offset": 1.0 if clamped else 0.0,
            "activation_func_clamp_value": limit if clamped else None}


def _biases_to_tree(add_bias_linear: bool) -> dict:
    """Megatron-Core's `add_bias_linear` gives its MoE layers' experts and router biases."""
    return {"experts.bias": add_bias_linear, "router.bias": add_bias_linear}


def _biases_to_megatron(experts_bias: bool, router_bias: Optional[bool]) -> dict:
    if experts_bias != bool(router_bias):
        raise ConfigError(f"experts.bias={experts_bias} with router.bias={router_bias}: "
                          "Megatron-Core's add_bias_linear gives the experts and the router "
                          "biases together; set both alike")
    return {"add_bias_linear": experts_bias}


LINKS: tuple[Link, ...] = (
    _same("num_moe_experts", "num_experts", host=True),
    _same("moe_ffn_hidden_size", "ffn_hidden_size", host=True),
    _same("moe_router_topk", "topk"),
    _same("moe_router_score_function", "router.score_function"),
    _same("moe_router_pre_softmax", "router.pre_softmax"),
    _same("moe_router_topk_scaling_factor", "router.topk_scaling_factor"),
    _same("moe_router_num_groups", "router.num_groups"),
    _same("moe_router_group_topk", "router.groups_per_token"),
    _same("moe_router_dtype", "router.dtype", off="fp32"),
    _same("moe_input_jitter_eps", "router.input_jitter_eps"),
    _same("moe_enable_routing_replay", "router.replay"),
    Link(("moe_router_load_balancing_type", "moe_aux_loss_coeff",
          "moe_router_enable_expert_bias"), ("balancing.methods", "balancing.aux_loss_coeff"),
         _balancing_to_tree, _balancing_to_megatron, host=True),
    _same("moe_router_bias_update_rate", "balancing.bias_update_rate", host=True),
    Link(("moe_router_quantile_balancing_ema",), ("balancing.quantile_ema",),
         _quantile_ema_to_tree, lambda ema: {"moe_router_quantile_balancing_ema": ema},
         host=True),
    _same("moe_z_loss_coeff", "balancing.z_loss_coeff", off=0.0),
    _same("moe_token_dispatcher_type", "dispatcher.kind"),
    _same("moe_expert_capacity_factor", "dispatcher.capacity_factor"),
    _same("moe_token_drop_policy", "dispatcher.drop_policy"),
    _same("moe_shared_expert_intermediate_size", "shared_expert.ffn_hidden_size", host=True),
    _same("moe_latent_size", "experts.latent_size"),
    _same("moe_shared_expert_gate", "shared_expert.gate"),
    Link(("activation_func", "gated_linear_unit", "glu_linear_offset",
          "activation_func_clamp_value"), ("experts.activation", "experts.swiglu_limit"),
         _activation_to_tree, _activation_to_megatron),
    Link(("add_bias_linear",), ("experts.bias", "router.bias"), _biases_to_tree,
         _biases_to_megatron),
)
"""The one mapping between Megatron-Core's MoE settings and the MoEConfig tree, read in both
directions: `moe_config_from_transformer_config` (Megatron-LM's `--moe-*` flags -> MoEConfig)
and `transformer_config_settings` (MoEConfig -> TransformerConfig fields)."""

HOST_LINKS = tuple(link for link in LINKS if link.host)
"""What a TransformerConfig written for megamoe's own layers carries (see `Link.host`)."""


HONOURED = frozenset({name for link in LINKS for name in link.megatron} | {
    "moe_layer_freq",  # the specs' dense/MoE layer pattern
    # Read by Megatron-LM's logging (megamoe saves per-layer values to Megatron's tracker) and by
    # its pipeline schedules (the MoEAuxLossAutoScaler scale, which megamoe's losses use).
    "moe_per_layer_logging", "moe_grad_scale_func",
    # Megatron-Core turns it into selective recompute of "moe" (recompute_modules), which
    # MegatronMoELayer.forward honours.
    "moe_layer_recompute",
})
"""Megatron-Core fields megamoe honours: the table's, and those read around megamoe's layers."""


def moe_config_from_transformer_config(tc: Any, overrides: Optional[dict] = None) -> MoEConfig:
    """The MoEConfig a Megatron-Core TransformerConfig's MoE fields say (`LINKS`; the layer's
    width and init std are the model's), with nested `overrides` deep-merged on top
    (`MoEConfig.merged`'s rule: a router of another kind replaces the router section).

    Every `moe_*` field of the installed TransformerConfig is honoured or, when set to a
    value megamoe cannot honour, refused with a ConfigError naming the field and the fix
    (`check_megatron_fields`). `moe_router_enable_expert_bias` adds `bias` to the
    load-balancing losses of `moe_router_load_balancing_type` (one weight each from
    `moe_aux_loss_coeff`).
    """
    if tc.num_moe_experts is None:
        raise ConfigError(
            "TransformerConfig.num_moe_experts is None; set --num-experts to build an MoE layer"
        )
    check_megatron_fields(tc)
    tree: dict[str, Any] = {"hidden_size": tc.hidden_size, "init_method_std": tc.init_method_std}
    for link in LINKS:
        values = (getattr(tc, name, None) for name in link.megatron)
        for path, value in link.to_tree(*values).items():
            *sections, name = path.split(".")
            part = tree
            for section_name in sections:
                part = part.setdefault(section_name, {})
            part[name] = value
    return MoEConfig.from_dict(deep_merge(tree, overrides or {}),
                               "in the TransformerConfig's MoE settings and their overrides")


def transformer_config_settings(moe: MoEConfig, owner: StepOwner,
                                links: tuple[Link, ...] = LINKS) -> dict[str, Any]:
    """TransformerConfig fields saying `moe`'s settings of `links` (`HOST_LINKS`: those
    Megatron-Core acts on around megamoe's layers). `moe_router_enable_expert_bias` is on only
    when Megatron's finalize_model_grads is the one to update the expert biases (`owner`). A
    field this megatron-core's TransformerConfig lacks is left out (quantile balancing's EMA on
    0.16, where megamoe alone runs it)."""
    settings: dict[str, Any] = {}
    for link in links:
        settings.update(link.to_megatron(*(_at(moe, path) for path in link.tree)))
    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    settings = {name: value for name, value in settings.items() if name in known}
    if "moe_router_enable_expert_bias" in settings:
        settings["moe_router_enable_expert_bias"] &= owner is StepOwner.FINALIZE_MODEL_GRADS
    return settings


def _at(moe: MoEConfig, path: str) -> Any:
    """The value at dotted `path` of the tree (None for a router setting this router lacks)."""
    value: Any = moe
    for name in path.split("."):
        value = getattr(value, name, None)
    return value
