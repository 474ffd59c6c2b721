"""The Python API holds settings to the types the YAML reader does (issue 54, item 5).

- `MoEConfig(...)` and every other settings dataclass check their fields in `__post_init__`
  (`megamoe.settings.check_fields`): a string, list or dict where a number, flag or section
  belongs is a one-line ConfigError naming the field; a section takes its object, a mapping of
  its settings, or (`balancing`) the shorthand of a method name or list of them.
- The spec functions still read the flat MoE keywords of before the settings tree, for one
  release, with a FutureWarning naming the new form, and build the same spec as that form.
"""
import dataclasses
import re
import typing
import warnings
from pathlib import Path
from typing import Any, Union

import pytest
import torch

from megamoe import BalancingConfig, ConfigError, MoEConfig
from megamoe.balancing import step_balancing
from megamoe.config import RouterConfig
from megamoe.layer import MoELayer
from megamoe.megatron.fields import moe_config_from_transformer_config
from megamoe.megatron.specs import (OLD_KEYWORDS, SpecKeywordError, gpt_decoder_block_spec,
                                    gpt_layer_spec, interleaved_layer_spec, moe_mlp_spec)
from megamoe.registry import DISPATCHERS, ROUTERS
from megamoe.settings import KINDS
from megamoe.train.config import TrainConfig
from megamoe.train.settings.moe import MoESection
from tiny_models import tiny_transformer_config

BASE = dict(hidden_size=16, num_experts=4, ffn_hidden_size=8)


def one_line_error(call, *names: str) -> str:
    """The message of the ConfigError `call()` raises; one line naming each of `names`."""
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, (name, message)
    return message


# --- the README's plain-PyTorch example -----------------------------------------------------

def test_readme_example_runs_forward_backward_and_step_balancing():
    """The README's plain-PyTorch layer as issue 54 quotes it (the balancing shorthand; the
    same as the section the README writes), on a small input."""
    torch.manual_seed(0)
    moe = MoELayer(MoEConfig(hidden_size=512, num_experts=8, ffn_hidden_size=1024, topk=2,
                             balancing=["bias", "aux_loss"]))
    assert moe.cfg.balancing == BalancingConfig(methods=["bias", "aux_loss"])
    x_SBD = torch.randn(4, 2, 512, requires_grad=True)
    y_SBD, _ = moe(x_SBD)
    assert y_SBD.shape == x_SBD.shape
    y_SBD.square().mean().backward()
    assert x_SBD.grad is not None and torch.isfinite(x_SBD.grad).all()
    metrics = step_balancing(moe)
    assert metrics


@pytest.mark.parametrize("shorthand, methods", [
    (["bias", "aux_loss"], ["bias", "aux_loss"]),
    (("bias", "seq_aux_loss"), ["bias", "seq_aux_loss"]),
    ("bias", "bias"),
])
def test_balancing_shorthand_is_the_methods_list(shorthand, methods):
    config = MoEConfig(**BASE, balancing=shorthand)
    assert config == MoEConfig(**BASE, balancing=BalancingConfig(methods=methods))
    assert config == MoEConfig.from_dict({**BASE, "balancing": {"methods": methods}})
    assert MoEConfig.from_dict({**BASE, "balancing": shorthand}) == config


# --- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, names", [
    (dict(router="topk"), ["router='topk'", "RouterConfig", "{'kind': 'topk'}"]),
    (dict(topk="2"), ["topk='2'", "int"]),
    (dict(topk=True), ["topk=True", "int"]),
    (dict(topk=2.0), ["topk=2.0", "int"]),
    (dict(num_experts=[4]), ["num_experts=[4]", "int"]),
    (dict(init_method_std="0.02"), ["init_method_std='0.02'", "float"]),
    (dict(init_method_std=True), ["init_method_std=True", "float"]),
    (dict(balancing=[1, 2]), ["balancing=[1, 2]", "BalancingConfig", "method name"]),
    (dict(balancing=3), ["balancing=3", "BalancingConfig"]),
    (dict(balancing=["bias", "bais"]), ["balancing.methods", "bais", "'bias'"]),
    (dict(balancing={"method": "bias"}), ["balancing.method", "balancing.methods"]),
    (dict(dispatcher="allgather"), ["dispatcher='allgather'", "{'kind': 'allgather'}"]),
    (dict(experts="gelu"), ["experts='gelu'", "ExpertsConfig"]),
    (dict(shared_expert=None), ["shared_expert=None", "SharedExpertConfig"]),
    (dict(router={"kind": "topk", "num_groups": "4"}), ["router.num_groups='4'", "int"]),
])
def test_moe_config_refuses_wrong_types_in_one_line(changes, names):
    one_line_error(lambda: MoEConfig(**{**BASE, **changes}), *names)


@pytest.mark.parametrize("make, names", [
    (lambda: BalancingConfig(aux_loss_coeff="0.01"), ["balancing.aux_loss_coeff", "float"]),
    (lambda: BalancingConfig(bias_mean_centering=1), ["balancing.bias_mean_centering", "bool"]),
    (lambda: BalancingConfig(bias_update_schedule=[[10, "0"]]),
     ["balancing.bias_update_schedule", "float"]),
    (lambda: ROUTERS.config_class("topk")(score_function=1), ["router.score_function", "str"]),
    (lambda: ROUTERS.config_class("threshold")(warmup_steps=1.5), ["router.warmup_steps", "int"]),
])
def test_sections_refuse_wrong_types_in_one_line(make, names):
    one_line_error(make, *names)


def test_a_section_may_be_a_mapping_of_its_settings():
    """A mapping is read as a config file's section would be (the router's class by its kind),
    and an int where a float belongs is that float."""
    config = MoEConfig(**BASE, router={"kind": "threshold", "ema_decay": 0.9},
                       balancing={"methods": "seq_aux_loss"}, init_method_std=1)
    assert type(config.router) is ROUTERS.config_class("threshold")
    assert config.router.ema_decay == 0.9
    assert config.balancing == BalancingConfig(methods="seq_aux_loss")
    assert config.init_method_std == 1.0 and isinstance(config.init_method_std, float)
    assert config == MoEConfig.from_dict(config.to_dict())


def test_trainer_sections_may_be_mappings_and_are_checked():
    moe = MoESection(**BASE)
    config = TrainConfig(moe=moe, training={"train_steps": 5}, output_dir=Path("runs/x"))
    assert config.training.train_steps == 5 and config.output_dir == "runs/x"
    one_line_error(lambda: TrainConfig(moe=moe, training=5), "training=5", "TrainingConfig")
    one_line_error(lambda: TrainConfig(moe=moe, optimizer={"muon": {"nesterov": "no"}}),
                   "optimizer.muon.nesterov='no'", "bool")
    one_line_error(lambda: TrainConfig(moe=moe, training={"train_step": 5}),
                   "training.train_step", "training.train_steps")


# --- every settings dataclass -----------------------------------------------------------------

def _sections(kind: type, prefix: str) -> dict[type, str]:
    """{settings class: the prefix its errors use} of the tree under `kind`: each section's
    class, and every class of a polymorphic section's registry."""
    found = {kind: prefix}
    hints = typing.get_type_hints(kind)
    for settings_field in dataclasses.fields(kind):
        declared = hints[settings_field.name]
        if not dataclasses.is_dataclass(declared):
            continue
        registry = settings_field.metadata.get(KINDS)
        classes = [c for _, c in registry.configured()] if registry else [declared]
        name = f"{prefix}.{settings_field.name}" if prefix else settings_field.name
        for section_class in classes:
            found.update({k: v for k, v in _sections(section_class, name).items()
                          if k not in found})
    return found


SECTIONS = {**_sections(TrainConfig, ""), **_sections(MoEConfig, "")}
"""Each class under the name its own checks use (the MoE tree's unprefixed, as MoEConfig's)."""
# MoESection is MoEConfig's checks (unprefixed names) plus layer_overrides.
SECTIONS[MoESection] = ""
REQUIRED = {MoEConfig: BASE, MoESection: BASE, TrainConfig: {"moe": MoESection(**BASE)}}


def test_the_sections_cover_the_registries():
    for _, router_class in ROUTERS.configured():
        assert router_class in SECTIONS
    for _, dispatcher_class in DISPATCHERS.configured():
        assert dispatcher_class in SECTIONS
    assert len(SECTIONS) >= 20


def _wrong_values(hint: Any) -> list:
    """Values of another type than `hint` (str, list or dict where they do not belong)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _wrong_values(options[0])
        wrong = [{"a": 1}]
        if all(typing.get_origin(a) is list or a in (int, float, bool) for a in options):
            wrong.append("1")
        return wrong
    if origin in (list, tuple):
        return [5, {"a": 1}]
    if hint is dict or origin is dict:
        return [[1], "x"]
    if dataclasses.is_dataclass(hint):
        return [[1], 5]
    return {int: ["2", True, 2.5, [2]], float: ["0.5", True, [0.5]], bool: ["true", 1],
            str: [3, ["x"], {"x": 1}]}.get(hint, [])


CASES = [(kind, name, value)
         for kind in SECTIONS
         for name, hint in typing.get_type_hints(kind).items()
         if name in {f.name for f in dataclasses.fields(kind) if f.init}
         for value in _wrong_values(hint)]


@pytest.mark.parametrize("kind, name, value", CASES,
                         ids=[f"{k.__name__}.{n}={v!r}" for k, n, v in CASES])
def test_every_settings_field_refuses_another_type(kind, name, value):
    prefix = SECTIONS[kind]
    key = f"{prefix}.{name}" if prefix else name
    one_line_error(lambda: kind(**{**REQUIRED.get(kind, {}), name: value}), f"{key}=")


@pytest.mark.parametrize("kind", list(SECTIONS), ids=lambda k: k.__name__)
def test_every_settings_class_takes_its_defaults(kind):
    """Each class built with only its required settings passes its own type check (defaults
    of the annotated types), and a section mapping reads as the section's object."""
    settings = kind(**REQUIRED.get(kind, {}))
    fields = {f.name: f for f in dataclasses.fields(kind)}
    for name, hint in typing.get_type_hints(kind).items():
        if dataclasses.is_dataclass(hint) and not fields[name].metadata.get(KINDS):
            section = getattr(settings, name)
            as_mapping = kind(**{**REQUIRED.get(kind, {}), name: dataclasses.asdict(section)})
            assert getattr(as_mapping, name) == section


def test_router_subclass_checks_its_own_fields():
    threshold = ROUTERS.config_class("threshold")
    assert issubclass(threshold, RouterConfig)
    one_line_error(lambda: threshold(capacity="0.5"), "router.capacity='0.5'")


# --- the spec functions' old flat keywords ----------------------------------------------------

@pytest.fixture(scope="module")
def tc():
    return tiny_transformer_config(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)


def _moe_of(layer_spec) -> MoEConfig:
    return layer_spec.submodules.mlp.params["moe"]


def _old_call(call, at_user: bool = True) -> Any:
    """`call()`'s result, and that it warned once with a FutureWarning naming the new form."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(future) == 1, [str(w.message) for w in caught]
    assert "deprecated" in str(future[0].message)
    if at_user:
        assert future[0].filename == __file__  # shown at the user's call
    return result, str(future[0].message)


def test_gpt_layer_spec_reads_old_keywords_with_a_warning(tc):
    old, message = _old_call(lambda: gpt_layer_spec(tc, activation="gelu",
                                                    score_function="softmax"))
    changes = {"experts": {"activation": "gelu"}, "router": {"score_function": "softmax"}}
    assert f"moe=moe_config_from_transformer_config(config, {changes!r})" in message
    new = gpt_layer_spec(tc, moe=moe_config_from_transformer_config(tc, changes))
    assert _moe_of(old) == _moe_of(new)
    assert _moe_of(old).experts.activation == "gelu"
    assert old == new


def test_gpt_layer_spec_old_keywords_merge_over_a_given_moe(tc):
    base = moe_config_from_transformer_config(tc)
    old, message = _old_call(lambda: gpt_layer_spec(tc, moe=base, topk=1, capacity_factor=1.5))
    assert "moe=moe.merged(" in message
    new = gpt_layer_spec(tc, moe=base.merged({"topk": 1,
                                              "dispatcher": {"capacity_factor": 1.5}}))
    assert _moe_of(old) == _moe_of(new) and old == new


def test_gpt_decoder_block_spec_reads_old_keywords(tc):
    old, _ = _old_call(lambda: gpt_decoder_block_spec(tc, balancing=["bias", "aux_loss"],
                                                      router_dtype="fp64", pp_rank=0))
    new = gpt_decoder_block_spec(tc, moe_config_from_transformer_config(
        tc, {"balancing": {"methods": ["bias", "aux_loss"]}, "router": {"dtype": "fp64"}}),
        pp_rank=0)
    assert [_moe_of(s) for s in old.layer_specs] == [_moe_of(s) for s in new.layer_specs]
    assert old == new


def test_flat_layer_overrides_are_nested_with_a_warning(tc):
    old, _ = _old_call(lambda: gpt_decoder_block_spec(
        tc, layer_overrides={1: {"score_function": "sigmoid"}}, pp_rank=0), at_user=False)
    new = gpt_decoder_block_spec(tc, layer_overrides={1: {"router": {"score_function":
                                                                     "sigmoid"}}}, pp_rank=0)
    assert old == new
    assert _moe_of(old.layer_specs[1]).router.score_function == "sigmoid"


def test_moe_mlp_spec_reads_old_keywords_over_its_moe(tc):
    base = moe_config_from_transformer_config(tc)
    old, _ = _old_call(lambda: moe_mlp_spec(base, bias_width=8, drop_policy="position"))
    assert old == moe_mlp_spec(base.merged({"dispatcher": {"drop_policy": "position"}}),
                               bias_width=8)
    # without a MoEConfig to change, or an old positional bias_width: one line, no traceback
    one_line_error(lambda: moe_mlp_spec(topk=1), "moe_mlp_spec", "moe=MoEConfig")
    one_line_error(lambda: moe_mlp_spec(8), "moe_mlp_spec(moe=8)", "MoEConfig")


def test_interleaved_layer_spec_reads_old_keywords_as_moe_overrides():
    old, message = _old_call(lambda: interleaved_layer_spec(1, activation="gelu"))
    assert "moe_overrides={'experts': {'activation': 'gelu'}}" in message
    new = interleaved_layer_spec(1, moe_overrides={"experts": {"activation": "gelu"}})
    assert old == new and old.params["moe_overrides"] == {"experts": {"activation": "gelu"}}


@pytest.mark.parametrize("call, near", [
    (lambda c: gpt_layer_spec(c, score_fuction="softmax"), "score_function"),
    (lambda c: gpt_layer_spec(c, use_transformer_engin=False), "use_transformer_engine"),
    (lambda c: gpt_decoder_block_spec(c, first_k_dens=1), "first_k_dense"),
    (lambda c: interleaved_layer_spec(blok=True), "block"),
    (lambda c: moe_mlp_spec(bias_widht=8), "bias_width"),
])
def test_an_unknown_keyword_names_the_closest_known_one(tc, call, near):
    with pytest.raises(SpecKeywordError) as info:
        call(tc)
    message = str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)
    assert "\n" not in message and re.search(f"did you mean '{near}'", message), message


def test_old_keywords_are_the_flat_settings_of_before_the_tree():
    assert {"activation", "score_function", "balancing", "router_type", "capacity_factor",
            "num_experts", "topk"} <= set(OLD_KEYWORDS)
