"""Every `moe_*` field of the installed TransformerConfig is honoured or refused, never dropped."""
import dataclasses

import pytest
import torch
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer import TransformerConfig

from megamoe import ConfigError, MoEConfig
from megamoe.balancing.owner import StepOwner
from megamoe.layer import MoELayer
from megamoe.megatron.fields import (HOST_LINKS, REFUSED, classify,
                                     moe_config_from_transformer_config,
                                     transformer_config_settings)
from tiny_models import tiny_transformer_config

MOE_FIELDS = [f.name for f in dataclasses.fields(TransformerConfig) if f.name.startswith("moe_")]


def tc(**changes):
    return tiny_transformer_config(**{**dict(num_moe_experts=4, moe_router_topk=2,
                                             moe_ffn_hidden_size=16), **changes})


@pytest.mark.parametrize("name", MOE_FIELDS)
def test_every_installed_moe_field_is_classified(name):
    """A field added by a new megatron-core fails here until megamoe classifies it."""
    assert classify(name) != "unknown", f"TransformerConfig.{name} is not classified"


REFUSED_VALUES = {
    "moe_extended_tp": True,
    "moe_router_topk_limited_devices": 2, "moe_router_padding_for_quantization": True,
    "moe_router_padding_for_fp8": True, "moe_router_force_load_balancing": True,
    "moe_token_dropping": True, "moe_pad_expert_input_to_capacity": True,
    "moe_apply_probs_on_input": True,
}


@pytest.mark.parametrize("name", [n for n in MOE_FIELDS if classify(n) == "refused"])
def test_refused_fields_name_the_field_and_the_fix(name):
    config = tc()
    object.__setattr__(config, name, REFUSED_VALUES.get(name, True))
    with pytest.raises(ConfigError) as err:
        moe_config_from_transformer_config(config)
    assert str(err.value).startswith(f"{name}=") and REFUSED[name] in str(err.value)


def test_unknown_field_from_a_newer_megatron_is_refused_unless_default():
    @dataclasses.dataclass
    class NewerConfig(TransformerConfig):
        moe_brand_new_knob: int = 0

    base = {f.name: getattr(tc(), f.name) for f in dataclasses.fields(TransformerConfig)
            if f.init}
    assert moe_config_from_transformer_config(NewerConfig(**base)).num_experts == 4
    with pytest.raises(ConfigError, match="moe_brand_new_knob=3 is a Megatron-Core setting"):
        moe_config_from_transformer_config(NewerConfig(**base, moe_brand_new_knob=3))


@pytest.mark.parametrize("changes, message", [
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type='flex' is not supported"),
    (dict(activation_func=quick_gelu, gated_linear_unit=True, glu_linear_offset=1.0),
     "gated activation 'quick_gelu' with glu_linear_offset=1.0, activation_func_clamp_value=None"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "'sinkhorn' is not supported by megamoe"),
])
def test_other_refusals(changes, message):
    config = tc()
    for name, value in changes.items():
        object.__setattr__(config, name, value)
    with pytest.raises(ConfigError, match=message):
        moe_config_from_transformer_config(config)


@pytest.mark.parametrize("changes, message", [
    (dict(moe_aux_loss_coeff=1e-2), "moe_aux_loss_coeff=0.01, moe_router_enable_expert_bias="
                                    "False: quantile balancing sets the load by its own bias"),
    (dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
     "set --moe-aux-loss-coeff 0 and drop --moe-router-enable-expert-bias"),
    (dict(moe_router_load_balancing_type=["quantile_balancing", "aux_loss"],
          moe_aux_loss_coeff=[0.0, 1e-2]), r"'quantile_balancing' \(alone"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "takes no group-limited routing"),
])
def test_quantile_balancing_refusals_are_one_line(changes, message):
    config = tc(moe_aux_loss_coeff=0.0)
    object.__setattr__(config, "moe_router_load_balancing_type", "quantile_balancing")
    for name, value in changes.items():
        object.__setattr__(config, name, value)
    with pytest.raises(ConfigError, match=message) as err:
        moe_config_from_transformer_config(config)
    assert "\n" not in str(err.value)


def test_quantile_balancing_maps_both_ways():
    config = tc(moe_aux_loss_coeff=0.0)
    object.__setattr__(config, "moe_router_load_balancing_type", "quantile_balancing")
    if hasattr(config, "moe_router_quantile_balancing_ema"):
        object.__setattr__(config, "moe_router_quantile_balancing_ema", 0.25)
    cfg = moe_config_from_transformer_config(config)
    assert cfg.balancing.uses_quantile and not cfg.balancing.loss_coeffs
    settings = transformer_config_settings(cfg, StepOwner.FINALIZE_MODEL_GRADS)
    assert (settings["moe_router_load_balancing_type"], settings["moe_aux_loss_coeff"],
            settings["moe_router_enable_expert_bias"]) == ("quantile_balancing", 0.0, False)
    if hasattr(config, "moe_router_quantile_balancing_ema"):  # megatron-core 0.19
        assert cfg.balancing.quantile_ema == settings["moe_router_quantile_balancing_ema"] == 0.25
    else:
        assert "moe_router_quantile_balancing_ema" not in settings


def test_lists_of_losses_and_bias_compose():
    cfg = moe_config_from_transformer_config(tc(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss", "aux_loss"],
        moe_aux_loss_coeff=[1e-4, 1e-3, 0.0], moe_z_loss_coeff=1e-3))
    assert cfg.balancing.uses_expert_bias
    assert cfg.balancing.loss_coeffs == {"seq_aux_loss": 1e-4, "global_aux_loss": 1e-3}
    assert cfg.balancing.z_loss_coeff == 1e-3


def test_input_jitter_is_honoured_like_megatron():
    """Megatron multiplies the router input by U(1-eps, 1+eps) in training only."""
    cfg = moe_config_from_transformer_config(tc(moe_input_jitter_eps=0.1))
    assert cfg.router.input_jitter_eps == 0.1
    layer = MoELayer(cfg.merged({"hidden_size": 64}))
    x = torch.randn(64, 64)
    layer.eval()
    eval_logits = layer.router(x).logits_TE
    torch.testing.assert_close(eval_logits, x @ layer.router.weight.t())
    layer.train()
    torch.manual_seed(0)
    noise = torch.empty_like(x).uniform_(0.9, 1.1)
    torch.manual_seed(0)
    train_logits = layer.router(x).logits_TE
    torch.testing.assert_close(train_logits, (x * noise) @ layer.router.weight.t())


def test_dispatcher_and_capacity_fields_are_honoured():
    cfg = moe_config_from_transformer_config(tc(moe_token_dispatcher_type="alltoall",
                                               moe_expert_capacity_factor=1.5,
                                               moe_token_drop_policy="position"))
    assert cfg.dispatcher == MoEConfig.from_dict(
        {"hidden_size": 1, "num_experts": 1, "ffn_hidden_size": 1, "topk": 1, "dispatcher": {
            "kind": "alltoall", "capacity_factor": 1.5, "drop_policy": "position"}}).dispatcher


# ---------------------------------------------------------------------------------------------
# The one table, written into a TransformerConfig and read back

def tree(**sections):
    return MoEConfig.from_dict({"hidden_size": 16, "num_experts": 8, "ffn_hidden_size": 24,
                                "init_method_std": 0.02, **sections})


ROUND_TRIPS = {
    "defaults": tree(),
    "deepseek_v3": tree(topk=4, router={"score_function": "sigmoid", "num_groups": 4,
                                        "groups_per_token": 2, "topk_scaling_factor": 2.5},
                        balancing={"methods": ["bias", "seq_aux_loss"], "aux_loss_coeff": 1e-4,
                                   "bias_update_rate": 1e-2},
                        shared_expert={"ffn_hidden_size": 32}),
    "lists_and_capacity": tree(topk=1, router={"pre_softmax": True, "dtype": "fp64",
                                               "input_jitter_eps": 0.01},
                               balancing={"methods": ["aux_loss", "global_aux_loss"],
                                          "aux_loss_coeff": [1e-2, 1e-3], "z_loss_coeff": 1e-3},
                               dispatcher={"kind": "allgather", "capacity_factor": 1.25,
                                           "drop_policy": "position"},
                               experts={"activation": "gelu"},
                               shared_expert={"ffn_hidden_size": 8, "gate": True}),
    "squared_relu_no_balancing": tree(balancing={"methods": "none"},
                                      experts={"activation": "squared_relu"}),
    "gpt_oss": tree(topk=4, router={"bias": True},
                    experts={"activation": "clamped_swiglu", "swiglu_limit": 5.0, "bias": True}),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_the_table_round_trips_through_a_transformer_config(case):
    """MoEConfig -> TransformerConfig fields -> MoEConfig gives the object back: every setting
    Megatron's fields can say goes both ways through the one table."""
    cfg = ROUND_TRIPS[case]
    settings = transformer_config_settings(cfg, StepOwner.FINALIZE_MODEL_GRADS)
    tc = tiny_transformer_config(hidden_size=16, init_method_std=0.02, **settings)
    assert moe_config_from_transformer_config(tc) == cfg


def test_written_fields_are_megatrons_names_for_the_settings():
    """DeepSeek-V3's recipe in Megatron-LM's own flags (its pretraining examples)."""
    settings = transformer_config_settings(ROUND_TRIPS["deepseek_v3"],
                                           StepOwner.FINALIZE_MODEL_GRADS)
    assert {k: settings[k] for k in (
        "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
        "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
        "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate", "moe_shared_expert_intermediate_size",
        "gated_linear_unit")} == {
        "num_moe_experts": 8, "moe_ffn_hidden_size": 24, "moe_router_topk": 4,
        "moe_router_score_function": "sigmoid", "moe_router_num_groups": 4,
        "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5,
        "moe_router_load_balancing_type": ["seq_aux_loss"], "moe_aux_loss_coeff": [1e-4],
        "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-2,
        "moe_shared_expert_intermediate_size": 32, "gated_linear_unit": True}


def test_megamoes_own_step_owner_keeps_megatrons_bias_update_off():
    """A model whose biases megamoe's step_balancing updates tells finalize_model_grads to leave
    them alone; the host fields carry no router settings, so Megatron's checks of its own router
    (softmax top-1 without pre-softmax) are not made of megamoe's top-1 router."""
    cfg = tree(topk=1, balancing={"methods": ["bias", "aux_loss"], "bias_update_rate": 0.05},
               shared_expert={"ffn_hidden_size": 32})
    settings = transformer_config_settings(cfg, StepOwner.STEP_BALANCING, HOST_LINKS)
    assert not any(name.startswith("moe_router_") and name != "moe_router_enable_expert_bias"
                   and name != "moe_router_load_balancing_type"
                   and name != "moe_router_bias_update_rate"
                   and name != "moe_router_quantile_balancing_ema" for name in settings)
    tc = tiny_transformer_config(hidden_size=16, **settings)
    assert tc.moe_router_enable_expert_bias is False
    back = moe_config_from_transformer_config(tc)
    assert (back.num_experts, back.ffn_hidden_size, back.shared_expert.ffn_hidden_size,
            back.balancing.loss_coeffs, back.balancing.bias_update_rate) == (
        8, 24, 32, {"aux_loss": 1e-2}, 0.05)


def test_overrides_are_nested_changes_over_the_flags():
    cfg = moe_config_from_transformer_config(
        tc(moe_router_score_function="sigmoid"),
        {"topk": 1, "router": {"kind": "threshold", "warmup_steps": 3},
         "balancing": {"methods": "none"}})
    assert (cfg.router.kind, cfg.router.warmup_steps, cfg.topk, cfg.num_experts) == (
        "threshold", 3, 1, 4)
    with pytest.raises(ConfigError, match="did you mean 'moe.router.warmup_steps'"):
        moe_config_from_transformer_config(tc(), {"router": {"kind": "threshold",
                                                             "warmup_step": 3}})
