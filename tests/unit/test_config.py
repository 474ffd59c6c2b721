"""Every invalid MoEConfig gives a ConfigError naming the value and the fix."""
import pytest
import torch.nn.functional as F

from megamoe import ConfigError, MoEConfig
from megamoe.megatron.fields import moe_config_from_transformer_config

BASE = dict(hidden_size=16, num_experts=8, ffn_hidden_size=32)


@pytest.mark.parametrize("changes, message", [
    (dict(topk=9), "topk=9 exceeds num_experts=8"),
    (dict(topk=0), "topk=0 must be a positive integer"),
    (dict(num_experts=0), "num_experts=0 must be a positive integer"),
    (dict(router_type="top_p", top_p_threshold=0.0), "top_p_threshold=0.0 is outside (0, 1]"),
    (dict(router_type="top_p", top_p_threshold=1.5), "top_p_threshold=1.5 is outside (0, 1]"),
    (dict(router_type="top_p", score_function="sigmoid"), "set score_function='softmax'"),
    (dict(router_type="expert_choice"), "router_type='expert_choice' is not one of"),
    (dict(score_function="relu"), "score_function='relu' is not one of"),
    (dict(balancing="sinkhorn"), "balancing='sinkhorn' is not one of"),
    (dict(num_groups=3, groups_per_token=1), "num_groups=3 does not divide num_experts=8"),
    (dict(num_groups=4), "group-limited routing needs both set"),
    (dict(num_groups=4, groups_per_token=5), "groups_per_token=5 must be in 1..num_groups=4"),
    (dict(num_groups=4, groups_per_token=2, topk=3), "topk=3 is not a multiple of groups_per_token=2"),
    (dict(num_groups=4, groups_per_token=2, topk=2, group_score_topk=3),
     "group_score_topk=3 must be in 1..2"),
    (dict(num_groups=4, groups_per_token=1, topk=3), "topk=3 exceeds the 2 experts in"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff=-1.0 is negative"),
    (dict(shared_expert_gate=True), "shared_expert_gate=True without a shared expert"),
    (dict(activation="tanh"), "activation='tanh' is not one of"),
    (dict(router_dtype="bf16"), "router_dtype='bf16' is not one of"),
    (dict(drop_policy="random"), "drop_policy='random' is not one of"),
    (dict(init_method_std=-1.0), "init_method_std=-1.0 must be > 0"),
    (dict(aux_loss_coeff=float("nan")), "aux_loss_coeff=nan must be a finite number"),
    (dict(capacity_factor=float("inf")), "capacity_factor=inf must be a finite number"),
])
def test_invalid_config_names_value_and_fix(changes, message):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**{**BASE, **changes})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_experts_not_divisible_by_expert_parallel_size():
    with pytest.raises(ConfigError, match="num_experts=8 is not divisible by the expert-parallel size 3"):
        MoEConfig(**BASE).check_expert_parallel(3)


def test_replace_rejects_unknown_field():
    with pytest.raises(ConfigError, match="unknown MoEConfig field"):
        MoEConfig(**BASE).replace(num_expert=4)


def test_from_transformer_config_reads_megatron_moe_fields():
    from tiny_models import tiny_transformer_config

    tc = tiny_transformer_config(
        num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=48,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=2e-3, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=64,
        moe_expert_capacity_factor=1.25, moe_token_drop_policy="position", moe_z_loss_coeff=1e-3,
        gated_linear_unit=True, activation_func=F.silu)
    cfg = moe_config_from_transformer_config(tc, router_type="topk")
    assert (cfg.num_experts, cfg.topk, cfg.ffn_hidden_size, cfg.hidden_size) == (16, 4, 48, 64)
    assert (cfg.score_function, cfg.balancing, cfg.bias_update_rate) == ("sigmoid", ["bias"], 2e-3)
    assert (cfg.num_groups, cfg.groups_per_token, cfg.topk_scaling_factor) == (4, 2, 2.5)
    assert (cfg.shared_expert_ffn_size, cfg.capacity_factor, cfg.drop_policy) == (64, 1.25, "position")
    assert (cfg.z_loss_coeff, cfg.activation) == (1e-3, "swiglu")


def test_from_transformer_config_without_experts():
    from tiny_models import tiny_transformer_config

    with pytest.raises(ConfigError, match="num_moe_experts is None"):
        moe_config_from_transformer_config(tiny_transformer_config())
