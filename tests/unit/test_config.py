"""The MoEConfig tree: every invalid setting is a one-line ConfigError naming the setting, its
value and the fix; plain data reads back to the same tree; older flat configs map onto it."""
import dataclasses
import json

import pytest
import torch.nn.functional as F

from megamoe import (BalancingConfig, ConfigError, DispatcherConfig, ExpertsConfig, MoEConfig,
                     SharedExpertConfig)
from megamoe.config import FLAT_NAMES, nest_flat_settings
from megamoe.megatron.fields import moe_config_from_transformer_config
from megamoe.registry import DISPATCHERS, ROUTERS
from megamoe.settings import MODEL, ROLE, TRAINING, walk_fields

BASE = dict(hidden_size=16, num_experts=8, ffn_hidden_size=32)
GROUPS = {"num_groups": 4, "groups_per_token": 2}

OLD_FLAT_FIELDS = [
    "hidden_size", "num_experts", "ffn_hidden_size", "topk", "router_type", "score_function",
    "pre_softmax", "topk_scaling_factor", "num_groups", "groups_per_token", "group_score_topk",
    "balancing", "bias_update_rate", "bias_mean_centering", "aux_loss_coeff", "z_loss_coeff",
    "capacity_factor", "drop_policy", "activation", "shared_expert_ffn_size",
    "shared_expert_gate", "top_p_threshold", "entropy_loss_coeff", "gate_logit_norm",
    "adaptive_aux_decay", "adaptive_aux_sensitivity", "threshold_ema_decay",
    "threshold_warmup_steps", "threshold_capacity", "sinkhorn_tolerance",
    "sinkhorn_max_iterations", "erc_loss_coeff", "erc_noise", "erc_margin", "router_dtype",
    "dispatcher", "input_jitter_eps", "init_method_std",
]
"""The 38 fields of the flat MoEConfig before the tree, written out (not read from the code)."""


@pytest.mark.parametrize("changes, message", [
    (dict(topk=9), "topk=9 exceeds num_experts=8"),
    (dict(topk=0), "topk=0 must be a positive integer"),
    (dict(num_experts=0), "num_experts=0 must be a positive integer"),
    (dict(init_method_std=-1.0), "init_method_std=-1.0 must be > 0"),
    (dict(router={"kind": "top_p", "threshold": 0.0}), "router.threshold=0.0 is outside (0, 1]"),
    (dict(router={"kind": "top_p", "threshold": 1.5}), "router.threshold=1.5 is outside (0, 1]"),
    (dict(router={"kind": "top_p", "score_function": "sigmoid"}),
     "set router.score_function='softmax'"),
    (dict(router={"kind": "expert_choice"}), "router.kind='expert_choice' is not one of"),
    (dict(router={"score_function": "relu"}), "router.score_function='relu' is not one of"),
    (dict(router={"dtype": "bf16"}), "router.dtype='bf16' is not one of"),
    (dict(router={"num_groups": 3, "groups_per_token": 1}),
     "router.num_groups=3 does not divide num_experts=8"),
    (dict(router={"num_groups": 4}), "group-limited routing needs both set"),
    (dict(router={"num_groups": 4, "groups_per_token": 5}),
     "router.groups_per_token=5 must be in 1..router.num_groups=4"),
    (dict(router=GROUPS, topk=3), "topk=3 is not a multiple of router.groups_per_token=2"),
    (dict(router={**GROUPS, "group_score_topk": 3}), "router.group_score_topk=3 must be in 1..2"),
    (dict(router={"num_groups": 4, "groups_per_token": 1}, topk=3),
     "topk=3 exceeds the 2 experts in"),
    (dict(balancing={"methods": "sinkhorn"}), "balancing.methods='sinkhorn' is not one of"),
    (dict(balancing={"aux_loss_coeff": -1.0}), "balancing.aux_loss_coeff=-1.0 is negative"),
    (dict(balancing={"aux_loss_coeff": float("nan")}),
     "balancing.aux_loss_coeff=nan is not a finite number"),
    (dict(dispatcher={"capacity_factor": 0.0}), "dispatcher.capacity_factor=0.0 must be > 0"),
    (dict(dispatcher={"capacity_factor": float("inf")}),
     "dispatcher.capacity_factor=inf is not a finite number"),
    (dict(dispatcher={"drop_policy": "random"}), "dispatcher.drop_policy='random' is not one of"),
    (dict(experts={"activation": "tanh"}), "experts.activation='tanh' is not one of"),
    (dict(shared_expert={"gate": True}), "shared_expert.gate=True without a shared expert"),
])
def test_invalid_setting_names_its_place_value_and_fix(changes, message):
    with pytest.raises(ConfigError) as err:
        MoEConfig.from_dict({**BASE, **changes})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_sections_validate_when_built_in_python():
    """The same checks hold for a tree built from the section classes (no plain data)."""
    with pytest.raises(ConfigError, match="dispatcher.capacity_factor=0.0 must be > 0"):
        DispatcherConfig(capacity_factor=0.0)
    with pytest.raises(ConfigError, match=r"balancing.aux_loss_coeff=\[0.1\] has 1 values"):
        BalancingConfig(methods=["bias", "aux_loss", "seq_aux_loss"], aux_loss_coeff=[0.1])
    with pytest.raises(ConfigError, match="router.num_groups=3 does not divide num_experts=8"):
        MoEConfig(**BASE, router=ROUTERS.config_class("topk")(num_groups=3, groups_per_token=1))


def test_experts_not_divisible_by_expert_parallel_size():
    with pytest.raises(ConfigError, match="num_experts=8 is not divisible by the expert-parallel "
                                          "size 3"):
        MoEConfig(**BASE).check_expert_parallel(3)


@pytest.mark.parametrize("changes, message", [
    (dict(num_expert=4), "unknown config key 'moe.num_expert' in the MoE settings; did you "
                         "mean 'moe.num_experts'?"),
    (dict(router={"kind": "threshold", "ema_decy": 0.9}),
     "unknown config key 'moe.router.ema_decy' in the MoE settings; did you mean "
     "'moe.router.ema_decay'?"),
    (dict(dispatcher={"capacity_factr": 1.0}), "did you mean 'moe.dispatcher.capacity_factor'?"),
])
def test_unknown_setting_is_one_line_with_did_you_mean(changes, message):
    with pytest.raises(ConfigError) as err:
        MoEConfig.from_dict({**BASE, **changes})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_setting_of_another_router_kind_says_whose_it_is():
    with pytest.raises(ConfigError) as err:
        MoEConfig.from_dict({**BASE, "router": {"kind": "top_p", "num_groups": 2}})
    assert str(err.value).startswith(
        "moe.router.num_groups in the MoE settings is not a setting of router 'top_p' "
        "(it belongs to: topk)")
    with pytest.raises(ConfigError, match=r"not a setting of router 'topk' \(it belongs to: "
                                          r"threshold\)"):
        MoEConfig.from_dict({**BASE, "router": {"ema_decay": 0.9}})  # topk by default


def test_merged_replaces_a_router_of_another_kind_and_checks_keys():
    grouped = MoEConfig.from_dict({**BASE, "router": {**GROUPS, "score_function": "sigmoid"}})
    kept = grouped.merged({"router": {"topk_scaling_factor": 2.5}})
    assert (kept.router.num_groups, kept.router.topk_scaling_factor) == (4, 2.5)
    top_p = grouped.merged({"router": {"kind": "top_p"}})
    assert top_p.router == ROUTERS.config_class("top_p")()  # no topk or sigmoid carried over
    assert grouped.router.num_groups == 4  # the original is unchanged
    with pytest.raises(ConfigError, match="did you mean 'moe.num_experts'"):
        grouped.merged({"num_expert": 4})


def test_every_old_flat_name_has_a_place_in_the_tree():
    assert len(OLD_FLAT_FIELDS) == 38
    tree = {f.name for f in dataclasses.fields(MoEConfig)}
    sections = {"balancing": BalancingConfig, "dispatcher": DispatcherConfig,
                "experts": ExpertsConfig, "shared_expert": SharedExpertConfig}
    router_fields = {f.name for _, settings in ROUTERS.configured()
                     for f in dataclasses.fields(settings)}
    assert set(FLAT_NAMES) <= set(OLD_FLAT_FIELDS)
    for old in OLD_FLAT_FIELDS:
        if old in tree and old not in FLAT_NAMES:
            continue  # kept its name at the top of the tree
        section, name = FLAT_NAMES[old].split(".")
        fields = (router_fields if section == "router"
                  else {f.name for f in dataclasses.fields(sections[section])})
        assert name in fields, f"{old} -> {FLAT_NAMES[old]}"


def test_nest_flat_settings_reads_an_old_config():
    notes = []
    old = {**BASE, "router_type": "top_p", "top_p_threshold": 0.5, "entropy_loss_coeff": 0.0,
           "balancing": ["aux_loss", "seq_aux_loss"], "aux_loss_coeff": [0.01, 0.02],
           "capacity_factor": 1.5, "drop_policy": "position", "activation": "gelu",
           "shared_expert_ffn_size": 16, "shared_expert_gate": True, "router_dtype": "fp64"}
    cfg = MoEConfig.from_dict(nest_flat_settings(old, lambda *pair: notes.append(pair)))
    assert (cfg.router.kind, cfg.router.threshold, cfg.router.entropy_loss_coeff,
            cfg.router.dtype) == ("top_p", 0.5, 0.0, "fp64")
    assert (cfg.balancing.methods, cfg.balancing.aux_loss_coeff) == (
        ["aux_loss", "seq_aux_loss"], [0.01, 0.02])
    assert (cfg.dispatcher.capacity_factor, cfg.dispatcher.drop_policy) == (1.5, "position")
    assert (cfg.experts.activation, cfg.shared_expert) == ("gelu", SharedExpertConfig(16, True))
    assert ("router_type", "router.kind") in notes and ("activation", "experts.activation") in notes
    assert len(notes) == len(old) - len(BASE)
    nested = {"balancing": {"methods": "bias"}, "dispatcher": {"kind": "allgather"}}
    assert nest_flat_settings(nested) == nested  # a mapping is the tree's section, not flat
    with pytest.raises(ConfigError, match="moe.capacity_factor=1.0 and "
                                          "moe.dispatcher.capacity_factor=2.0 disagree"):
        nest_flat_settings({"capacity_factor": 1.0, "dispatcher": {"capacity_factor": 2.0}})


def _section_classes():
    """Every settings class of the tree: the fixed sections and each registered kind's."""
    fixed = [MoEConfig, BalancingConfig, ExpertsConfig, SharedExpertConfig]
    return fixed + [settings for registry in (ROUTERS, DISPATCHERS)
                    for _, settings in registry.configured()]


@pytest.mark.parametrize("settings", _section_classes(), ids=lambda c: c.__name__)
def test_every_leaf_setting_declares_its_role(settings):
    for f in dataclasses.fields(settings):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
                f.default_factory()):
            continue  # a section: its own leaves carry the roles
        assert f.metadata.get(ROLE) in (MODEL, TRAINING), f"{settings.__name__}.{f.name}"


def test_roles_separate_the_model_from_its_training():
    roles = {name: f.metadata[ROLE] for name, f, _ in walk_fields(MoEConfig(**BASE))}
    for name in ("num_experts", "ffn_hidden_size", "topk", "router.kind",
                 "router.score_function", "balancing.methods", "experts.activation",
                 "shared_expert.ffn_hidden_size"):
        assert roles[name] == MODEL, name
    for name in ("balancing.aux_loss_coeff", "balancing.bias_update_rate",
                 "balancing.bias_update_schedule", "dispatcher.kind",
                 "dispatcher.capacity_factor", "router.input_jitter_eps"):
        assert roles[name] == TRAINING, name


REQUIRED_ROUTER_SETTINGS = {"hash": {"vocab_size": 32}}  # the vocabulary its table covers


@pytest.mark.parametrize("kind", ROUTERS.names())
def test_to_dict_from_dict_round_trip_for_every_router(kind):
    settings = ROUTERS.config_class(kind)
    tree = {**BASE, "topk": 1, "router": {"kind": kind, **REQUIRED_ROUTER_SETTINGS.get(kind, {})},
            "balancing": {"methods": "aux_loss", "bias_update_schedule": [[10, 0.0]]},
            "dispatcher": {"kind": "allgather", "capacity_factor": 1.25}}
    cfg = MoEConfig.from_dict(tree)
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain data, as a checkpoint stores it
    assert data["router"]["kind"] == kind
    back = MoEConfig.from_dict(data)
    assert back == cfg and type(back.router) is settings


def test_from_transformer_config_reads_megatron_moe_fields():
    from tiny_models import tiny_transformer_config

    tc = tiny_transformer_config(
        num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=48,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=2e-3, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=64,
        moe_expert_capacity_factor=1.25, moe_token_drop_policy="position", moe_z_loss_coeff=1e-3,
        gated_linear_unit=True, activation_func=F.silu)
    cfg = moe_config_from_transformer_config(tc)
    assert (cfg.num_experts, cfg.topk, cfg.ffn_hidden_size, cfg.hidden_size) == (16, 4, 48, 64)
    assert (cfg.router.kind, cfg.router.score_function) == ("topk", "sigmoid")
    assert "bias" in cfg.balancing.kinds and cfg.balancing.bias_update_rate == 2e-3
    assert (cfg.router.num_groups, cfg.router.groups_per_token,
            cfg.router.topk_scaling_factor) == (4, 2, 2.5)
    assert (cfg.shared_expert.ffn_hidden_size, cfg.dispatcher.capacity_factor,
            cfg.dispatcher.drop_policy) == (64, 1.25, "position")
    assert (cfg.balancing.z_loss_coeff, cfg.experts.activation) == (1e-3, "swiglu")


def test_from_transformer_config_without_experts():
    from tiny_models import tiny_transformer_config

    with pytest.raises(ConfigError, match="num_moe_experts is None"):
        moe_config_from_transformer_config(tiny_transformer_config())
