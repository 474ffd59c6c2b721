"""What megamoe does with every `moe_*` field of Megatron-Core's TransformerConfig.

Each field is in exactly one class:
- HONOURED: read by `moe_config_from_transformer_config`, by the specs (`moe_layer_freq`) or by
  Megatron's own training loop around megamoe layers (logging, the aux-loss scale).
- NO_EFFECT: kernel, fusion, overlap or flex-dispatcher tuning; megamoe computes the same
  function with its own kernels, so any value is accepted.
- REFUSED: a behaviour megamoe does not implement; any value but the field's default raises a
  ConfigError naming the field and what to do.
A `moe_*` field that is in none of them (added by a newer megatron-core) is refused unless it
holds its default, so a new Megatron setting is never silently dropped.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn.functional as F

from megamoe.config import BALANCE_LOSSES, BIAS, MoEConfig
from megamoe.errors import ConfigError
from megamoe.registry import DISPATCHERS

HONOURED = frozenset({
    "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
    "moe_router_group_topk", "moe_router_dtype", "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_expert_capacity_factor",
    "moe_token_drop_policy", "moe_token_dispatcher_type", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    # Read by Megatron-LM's logging (megamoe saves per-layer values to Megatron's tracker) and by
    # its pipeline schedules (the MoEAuxLossAutoScaler scale, which megamoe's losses use).
    "moe_per_layer_logging", "moe_grad_scale_func",
    # Megatron-Core turns it into selective recompute of "moe" (recompute_modules), which
    # MegatronMoELayer.forward honours.
    "moe_layer_recompute",
})

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
    "moe_enable_routing_replay": f"megamoe does not record or replay routing; {_OFF}",
    "moe_router_topk_limited_devices": "use group-limited routing instead: "
                                       "--moe-router-num-groups and --moe-router-group-topk",
    "moe_router_padding_for_quantization": f"megamoe does not pad the routing map for FP8; {_OFF}",
    "moe_router_padding_for_fp8": f"megamoe does not pad the routing map for FP8; {_OFF}",
    "moe_router_force_load_balancing": f"megamoe has no benchmark-only random routing; {_OFF}",
    "moe_token_dropping": "use --moe-expert-capacity-factor for token dropping",
    "moe_enable_deepep": "megamoe dispatches with 'alltoall' or 'allgather'; turn DeepEP off",
    "moe_pad_expert_input_to_capacity": f"megamoe never pads expert inputs to capacity; {_OFF}",
    "moe_apply_probs_on_input": f"megamoe applies the gates to the expert outputs; {_OFF}",
    "moe_latent_size": "megamoe has no latent-space experts; leave it unset",
    "moe_expert_rank_capacity_factor": "use --moe-expert-capacity-factor (per expert) instead",
    "moe_mlp_glu_interleave_size": "megamoe stores GLU halves un-interleaved; leave it unset",
    "moe_shared_expert_glu_interleave_size": "megamoe stores GLU halves un-interleaved; leave it "
                                             "unset",
    "moe_pad_experts_for_cuda_graph_inference": f"megamoe does not capture CUDA graphs; {_OFF}",
    "moe_paged_stash": f"megamoe does not stash expert activations; {_OFF}",
    "moe_router_force_biased": f"megamoe has no forced-bias routing; {_OFF}",
    "moe_router_quantile_balancing_ema": "megamoe has no quantile balancing; leave it unset",
    "moe_single_grouped_bias": f"megamoe experts have no biases; {_OFF}",
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
    refused or unknown `moe_*` field away from its default, the flex dispatcher, or linear
    biases in the experts (`add_bias_linear`)."""
    if getattr(tc, "moe_token_dispatcher_type", "alltoall") not in DISPATCHERS:
        raise ConfigError(
            f"moe_token_dispatcher_type={tc.moe_token_dispatcher_type!r} is not supported by "
            f"megamoe; use one of {list(DISPATCHERS.names())}"
        )
    if getattr(tc, "add_bias_linear", False):
        raise ConfigError(
            "add_bias_linear=True: megamoe experts have no linear biases; pass "
            "--disable-bias-linear (add_bias_linear=False)"
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


def moe_config_from_transformer_config(tc: Any, **overrides: Any) -> MoEConfig:
    """Build from a Megatron-Core TransformerConfig's `moe_*` fields, then apply `overrides`.

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
    balancing, coeffs = _balancing_from_megatron(tc)
    values = dict(
        hidden_size=tc.hidden_size,
        num_experts=tc.num_moe_experts,
        ffn_hidden_size=tc.moe_ffn_hidden_size or tc.ffn_hidden_size,
        topk=tc.moe_router_topk,
        score_function=tc.moe_router_score_function,
        pre_softmax=tc.moe_router_pre_softmax,
        topk_scaling_factor=tc.moe_router_topk_scaling_factor,
        num_groups=tc.moe_router_num_groups,
        groups_per_token=tc.moe_router_group_topk,
        balancing=balancing,
        bias_update_rate=tc.moe_router_bias_update_rate,
        z_loss_coeff=tc.moe_z_loss_coeff or 0.0,
        capacity_factor=tc.moe_expert_capacity_factor,
        drop_policy=tc.moe_token_drop_policy,
        activation=_activation_from_megatron(tc),
        shared_expert_ffn_size=tc.moe_shared_expert_intermediate_size,
        shared_expert_gate=tc.moe_shared_expert_gate,
        router_dtype=tc.moe_router_dtype or "fp32",
        dispatcher=tc.moe_token_dispatcher_type,
        input_jitter_eps=tc.moe_input_jitter_eps,
        init_method_std=tc.init_method_std,
    )
    if coeffs:  # else MoEConfig's default weight, for losses the overrides turn on
        values["aux_loss_coeff"] = coeffs[0] if len(coeffs) == 1 else coeffs
    values.update(overrides)
    unknown = set(values) - {f.name for f in dataclasses.fields(MoEConfig)}
    if unknown:
        raise ConfigError(f"unknown MoEConfig field(s) {sorted(unknown)}; see megamoe.MoEConfig")
    return MoEConfig(**values)


def _balancing_from_megatron(tc: Any) -> tuple[list[str], list[float]]:
    """(balancing, aux_loss_coeff) from Megatron's load-balancing type(s), coefficient(s) and
    expert-bias flag. A loss whose coefficient is 0 is off, as in Megatron's router."""
    kinds = tc.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    coeffs = tc.moe_aux_loss_coeff
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    if len(coeffs) != len(kinds):
        raise ConfigError(
            f"moe_aux_loss_coeff={coeffs} has {len(coeffs)} values for "
            f"moe_router_load_balancing_type={kinds}; give one coefficient per type"
        )
    balancing, weights = [], []
    for kind, coeff in zip(kinds, coeffs):
        if kind == "none":
            continue
        if kind not in BALANCE_LOSSES:
            raise ConfigError(
                f"moe_router_load_balancing_type={kind!r} is not supported by megamoe; use "
                f"{list(BALANCE_LOSSES) + ['none']} and/or --moe-router-enable-expert-bias"
            )
        if coeff > 0:
            balancing.append(kind)
            weights.append(float(coeff))
    if tc.moe_router_enable_expert_bias:
        balancing.insert(0, BIAS)
    return balancing or ["none"], weights


def _activation_from_megatron(tc: Any) -> str:
    name = getattr(tc.activation_func, "__name__", str(tc.activation_func))
    if tc.gated_linear_unit:
        if tc.activation_func is F.silu:
            return "swiglu"
        raise ConfigError(
            f"gated activation {name!r} is not supported; use activation_func=F.silu (swiglu)"
        )
    if tc.activation_func is F.gelu:
        return "gelu"
    if "squared_relu" in name:
        return "squared_relu"
    raise ConfigError(
        f"activation {name!r} is not supported; use swiglu (gated silu), gelu or squared_relu"
    )
