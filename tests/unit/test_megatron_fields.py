"""Every `moe_*` field of the installed TransformerConfig is honoured or refused, never dropped."""
import dataclasses

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megamoe import ConfigError
from megamoe.layer import MoELayer
from megamoe.megatron.fields import REFUSED, classify, moe_config_from_transformer_config
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
    "moe_extended_tp": True, "moe_enable_routing_replay": True,
    "moe_router_topk_limited_devices": 2, "moe_router_padding_for_quantization": True,
    "moe_router_padding_for_fp8": True, "moe_router_force_load_balancing": True,
    "moe_token_dropping": True, "moe_pad_expert_input_to_capacity": True,
    "moe_apply_probs_on_input": True, "moe_latent_size": 8,
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
    (dict(add_bias_linear=True), "add_bias_linear=True: megamoe experts have no linear biases"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "'sinkhorn' is not supported by megamoe"),
])
def test_other_refusals(changes, message):
    config = tc()
    for name, value in changes.items():
        object.__setattr__(config, name, value)
    with pytest.raises(ConfigError, match=message):
        moe_config_from_transformer_config(config)


def test_lists_of_losses_and_bias_compose():
    cfg = moe_config_from_transformer_config(tc(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss", "aux_loss"],
        moe_aux_loss_coeff=[1e-4, 1e-3, 0.0], moe_z_loss_coeff=1e-3))
    assert cfg.uses_expert_bias
    assert cfg.balance_loss_coeffs == {"seq_aux_loss": 1e-4, "global_aux_loss": 1e-3}
    assert cfg.z_loss_coeff == 1e-3


def test_input_jitter_is_honoured_like_megatron():
    """Megatron multiplies the router input by U(1-eps, 1+eps) in training only."""
    cfg = moe_config_from_transformer_config(tc(moe_input_jitter_eps=0.1))
    assert cfg.input_jitter_eps == 0.1
    layer = MoELayer(cfg.replace(hidden_size=64))
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
    assert (cfg.dispatcher, cfg.capacity_factor, cfg.drop_policy) == ("alltoall", 1.5, "position")
