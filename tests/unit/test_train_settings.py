"""The trainer's config by section (megamoe/train/settings/): each section refuses its own bad
values when it is built, the `moe` section is the MoE settings tree (hidden size from the model,
flat keys of older configs read with a note, layer overrides merged and checked), overrides of
tree keys are checked against the tree. In-process and fast: nothing here builds a model."""
from __future__ import annotations

import pytest
import yaml

from megamoe.config import MoEConfig
from megamoe.errors import ConfigError
from megamoe.routing.top_p import TopPRouterConfig
from megamoe.routing.topk import TopKRouterConfig
from megamoe.settings import TRAINING, setting_roles
from megamoe.train.config import (apply_overrides, config_from_dict, dump_config, known_keys,
                                  load_config)
from megamoe.train.settings.checkpoint import CheckpointConfig
from megamoe.train.settings.data import DataConfig
from megamoe.train.settings.evaluation import EvaluationConfig
from megamoe.train.settings.finetune import FinetuneConfig
from megamoe.train.settings.guards import GuardsConfig
from megamoe.train.settings.logging import LoggingConfig
from megamoe.train.settings.model import ModelConfig
from megamoe.train.settings.optimizer import OptimizerConfig
from megamoe.train.settings.parallel import ParallelConfig
from megamoe.train.settings.training import TrainingConfig

MOE = {"num_experts": 8, "ffn_hidden_size": 32}


@pytest.mark.parametrize("make, message", [
    (lambda: ModelConfig(num_layers=0), "model.num_layers=0 must be >= 1"),
    (lambda: ModelConfig(hidden_dropout=1.0), "model.hidden_dropout=1.0 must be in [0, 1)"),
    (lambda: ModelConfig(num_query_groups=3), "model.num_query_groups=3 must divide"),
    (lambda: ModelConfig(first_k_dense=9), "model.first_k_dense=9 must be in 0..num_layers=4"),
    (lambda: ParallelConfig(expert=0), "parallel.expert=0 must be >= 1"),
    (lambda: ParallelConfig(virtual_stages=2), "parallel.virtual_stages=2 needs parallel.pipeline"),
    (lambda: DataConfig(num_workers=-1), "data.num_workers=-1 must be >= 0"),
    (lambda: DataConfig(prefixes=["a"]), "data.prefixes needs data.tokenizer"),
    (lambda: TrainingConfig(precision="fp8"), "training.precision='fp8' is not one of"),
    (lambda: TrainingConfig(micro_batch_size=3), "training.global_batch_size=16 is not a multiple"),
    (lambda: OptimizerConfig(min_lr=1.0), "optimizer.min_lr=1.0 must be in [0, lr=0.0003]"),
    (lambda: CheckpointConfig(keep_last=-1), "checkpoint.keep_last=-1 must be >= 0"),
    (lambda: LoggingConfig(interval=0), "logging.interval=0 must be >= 1"),
    (lambda: GuardsConfig(spike_action="pause"), "guards.spike_action='pause' is not one of"),
    (lambda: EvaluationConfig(batches=0), "evaluation.batches=0 must be >= 1"),
    (lambda: FinetuneConfig(method="qlora"), "finetune.method='qlora' is not one of"),
])
def test_each_section_refuses_its_own_bad_values_where_it_is_built(make, message):
    with pytest.raises(ConfigError) as err:
        make()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_model_settings_have_the_roles_the_issue_gives_them():
    """Dropout, the initialisation's std and the MTP loss weight train the model; everything
    else defines it."""
    roles = setting_roles(ModelConfig())
    assert {name for name, role in roles.items() if role == TRAINING} == \
        {"hidden_dropout", "attention_dropout", "init_method_std", "mtp_loss_weight"}
    assert len(roles) == len(ModelConfig.__dataclass_fields__)


def test_the_guards_section_has_no_fault_injection_keys():
    assert not [key for key in known_keys() if "debug" in key]
    with pytest.raises(ConfigError, match="unknown config key 'guards.debug_nan_step'"):
        config_from_dict({"moe": MOE, "guards": {"debug_nan_step": 3}})


def test_moe_section_is_the_tree_with_the_models_width_and_activation():
    config = config_from_dict({"model": {"hidden_size": 64, "swiglu": False,
                                         "init_method_std": 0.01},
                               "moe": {**MOE, "router": {"score_function": "sigmoid"}}})
    expected = MoEConfig(hidden_size=64, num_experts=8, ffn_hidden_size=32,
                         init_method_std=0.01,
                         router=TopKRouterConfig(score_function="sigmoid"))
    expected.experts.activation = "gelu"  # model.swiglu=false, as Megatron's dense MLP
    assert config.moe_config() == expected
    assert config.moe.num_experts == 8 and config.moe.hidden_size == 64
    assert "hidden_size" not in config.to_dict()["moe"]
    # explicit MoE values win over the model's
    config = config_from_dict({"model": {"swiglu": False}, "moe": {
        **MOE, "init_method_std": 0.5, "experts": {"activation": "swiglu"}}})
    assert config.moe_config().experts.activation == "swiglu"
    assert config.moe_config().init_method_std == 0.5


@pytest.mark.parametrize("moe", [
    {**MOE, "hidden_size": 128},
    {**MOE, "layer_overrides": {1: {"hidden_size": 64}}},
])
def test_moe_hidden_size_is_refused_as_the_models(moe):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"moe": moe})
    assert "hidden_size=" in str(err.value) and "model.hidden_size" in str(err.value)


def test_layer_overrides_merge_over_the_section_per_layer():
    """A layer's nested settings are merged key by key over the section's; a router of another
    kind replaces the router section (the other kind's settings do not apply)."""
    config = config_from_dict({"moe": {
        **MOE, "router": {"score_function": "sigmoid", "num_groups": 4, "groups_per_token": 2},
        "balancing": {"methods": ["bias", "seq_aux_loss"], "aux_loss_coeff": 1e-4},
        "layer_overrides": {2: {"balancing": {"aux_loss_coeff": 0.5}, "num_experts": 16},
                            3: {"router": {"kind": "top_p", "threshold": 0.6}}}}})
    base = dict(hidden_size=128, num_experts=8, ffn_hidden_size=32)
    router = TopKRouterConfig(score_function="sigmoid", num_groups=4, groups_per_token=2)
    assert config.moe_config(1) == MoEConfig(**base, router=router).merged(
        {"balancing": {"methods": ["bias", "seq_aux_loss"], "aux_loss_coeff": 1e-4}})
    layer2 = config.moe_config(2)
    assert (layer2.num_experts, layer2.router, layer2.balancing.methods,
            layer2.balancing.aux_loss_coeff) == (16, router, ["bias", "seq_aux_loss"], 0.5)
    layer3 = config.moe_config(3)
    assert layer3.router == TopPRouterConfig(threshold=0.6)
    assert layer3.balancing.aux_loss_coeff == 1e-4


@pytest.mark.parametrize("overrides, message", [
    ({1: {"num_expert": 4}}, "unknown config key 'moe.layer_overrides.1.num_expert'"),
    ({1: {"router": {"kind": "topk", "threshold": 0.5}}},
     "moe.layer_overrides.1.router.threshold in the config is not a setting of router 'topk'"),
    ({1: {"topk": 9}}, "topk=9 exceeds num_experts=8"),
    ({-1: {"topk": 1}}, "moe.layer_overrides entry -1"),
    ({9: {"topk": 1}}, "moe.layer_overrides names layer 9, outside 0..3"),
    ({1: {"num_experts": 6}}, "num_experts=6 is not divisible by the expert-parallel size 4"),
    ({1: {"num_experts": 10**9}}, "moe.layer_overrides.1.num_experts=1000000000 is beyond the "
     "largest model megamoe builds (at most 65,536)"),
    ({1: {"num_experts": "1e9"}}, "moe.layer_overrides.1.num_experts='1e9' is not a valid int"),
])
def test_layer_overrides_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"moe": {**MOE, "layer_overrides": overrides},
                          "parallel": {"expert": 4}})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_flat_keys_of_older_configs_are_read_with_one_note_each(capsys):
    old = {"moe": {**MOE, "router_type": "top_p", "top_p_threshold": 0.6, "balancing": "bias",
                   "capacity_factor": 1.5,
                   "layer_overrides": {2: {"top_p_threshold": 0.7, "aux_loss_coeff": 0.5}}}}
    new = {"moe": {**MOE, "router": {"kind": "top_p", "threshold": 0.6},
                   "balancing": {"methods": "bias"}, "dispatcher": {"capacity_factor": 1.5},
                   "layer_overrides": {2: {"router": {"threshold": 0.7},
                                           "balancing": {"aux_loss_coeff": 0.5}}}}}
    assert capsys.readouterr().err == ""
    expected = config_from_dict(new)
    assert capsys.readouterr().err == ""
    assert config_from_dict(old) == expected
    assert capsys.readouterr().err.splitlines() == [
        "note: moe.router_type is now moe.router.kind (read as that)",
        "note: moe.top_p_threshold is now moe.router.threshold (read as that)",
        "note: moe.balancing is now moe.balancing.methods (read as that)",
        "note: moe.capacity_factor is now moe.dispatcher.capacity_factor (read as that)",
        "note: moe.layer_overrides.2.top_p_threshold is now "
        "moe.layer_overrides.2.router.threshold (read as that)",
        "note: moe.layer_overrides.2.aux_loss_coeff is now "
        "moe.layer_overrides.2.balancing.aux_loss_coeff (read as that)"]
    # what is saved is the tree: it reads back without a note
    assert config_from_dict(yaml.safe_load(dump_config(expected))) == expected
    assert "router_type" not in dump_config(expected)
    assert capsys.readouterr().err == ""


def test_notes_are_printed_once_per_load_and_only_on_rank_0(tmp_path, capsys, monkeypatch):
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"moe": {**MOE, "router_type": "top_p"}}))
    config = load_config(old, ["moe.router.threshold=0.6"])  # the file is read twice
    assert config.moe.router == TopPRouterConfig(threshold=0.6)
    assert capsys.readouterr().err == \
        "note: moe.router_type is now moe.router.kind (read as that)\n"
    monkeypatch.setenv("RANK", "1")
    assert load_config(old) == load_config(old, ["moe.router.threshold=0.4"])
    assert capsys.readouterr().err == ""


def test_flat_override_keys_are_read_as_tree_keys(tmp_path, capsys):
    """`moe.router_type=top_p` sets moe.router.kind (replacing the file's, tree or flat), with
    the note; in a layer's overrides too."""
    tree = tmp_path / "tree.yaml"
    tree.write_text(yaml.safe_dump({"moe": {**MOE, "router": {"kind": "topk"},
                                            "dispatcher": {"capacity_factor": 2.0}}}))
    config = load_config(tree, ["moe.router_type=top_p", "moe.capacity_factor=1.25",
                                "moe.layer_overrides.1.top_p_threshold=0.7"])
    assert config.moe.router == TopPRouterConfig()
    assert config.moe.dispatcher.capacity_factor == 1.25
    assert config.moe_config(1).router == TopPRouterConfig(threshold=0.7)
    assert capsys.readouterr().err.splitlines() == [
        "note: moe.router_type is now moe.router.kind (read as that)",
        "note: moe.capacity_factor is now moe.dispatcher.capacity_factor (read as that)",
        "note: moe.layer_overrides.1.top_p_threshold is now "
        "moe.layer_overrides.1.router.threshold (read as that)"]
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"moe": {**MOE, "router_type": "topk"}}))
    assert load_config(flat, ["moe.router.kind=top_p"]).moe.router == TopPRouterConfig()
    assert load_config(flat, ["moe.router_type=sinkhorn"]).moe.router.kind == "sinkhorn"


@pytest.mark.parametrize("override, near", [
    ("moe.router.knd=top_p", "moe.router.kind"),
    ("moe.balancing.aux_los_coeff=0.1", "moe.balancing.aux_loss_coeff"),
    ("moe.dispatcher.capacity_factr=1", "moe.dispatcher.capacity_factor"),
    ("moe.layer_overrides.2.router.scor_function=sigmoid",
     "moe.layer_overrides.2.router.score_function"),
])
def test_overrides_of_tree_keys_are_checked_against_the_tree(override, near):
    with pytest.raises(ConfigError) as err:
        apply_overrides({"moe": MOE}, [override])
    assert str(err.value).startswith(f"unknown config key '{override.split('=')[0]}' in "
                                     f"override '{override}'")
    assert f"did you mean '{near}'?" in str(err.value)


def test_overrides_reach_the_settings_of_any_router():
    raw = apply_overrides({"moe": MOE}, ["moe.router.kind=threshold", "moe.router.ema_decay=0.9",
                                         "moe.balancing.aux_loss_coeff=0.02"])
    config = config_from_dict(raw)
    assert (config.moe.router.kind, config.moe.router.ema_decay) == ("threshold", 0.9)
    assert config.moe.balancing.aux_loss_coeff == 0.02


def test_an_override_key_of_non_ascii_digits_is_an_unknown_key():
    """'⁴' is a digit to str.isdigit but no int: the key is named, not a traceback."""
    with pytest.raises(ConfigError, match="unknown config key '⁴' in override '⁴=true'"):
        apply_overrides({"moe": MOE}, ["⁴=true"])
