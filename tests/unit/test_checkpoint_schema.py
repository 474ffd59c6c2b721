"""The versioned schema of megamoe's training checkpoints: format 2 keeps the settings tree, a
format-1 checkpoint (the committed tests/fixtures/mcore_checkpoints, written by megamoe before
the tree under megatron-core 0.16.1 and 0.19.2, and a literal format-1 common state) is read
through UPGRADES[1], and a resumed run may change a training setting (returned, for the trainer
to announce) but not a model setting (refused by name). The expected trees and messages are
written out by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megamoe import CheckpointError
from megamoe.checkpointing.safe_dcp import load_common_state
from megamoe.train import checkpoint_schema
from megamoe.train.checkpoint import interpret_common_state
from megamoe.train.checkpoint_schema import (SettingChange, check_compatible, training_changes,
                                             upgraded)
from megamoe.train.config import load_config
from megamoe.train.metrics import MetricsLogger

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mcore_checkpoints"
FOLDERS = sorted(FIXTURES.glob("mcore-*/checkpoints/iter_*"))
HERE = Path("ckpt")


def fixture_config(*overrides: str):
    data = FIXTURES / "data" / "synthetic"
    return load_config(str(FIXTURES / "config.yaml"),
                       [f"data.prefixes=[{data}]", f"data.tokenizer={data}.model", *overrides])


def saved_config(*overrides: str) -> dict:
    """A format-2 checkpoint's saved config: the fixtures' config as a run saves it."""
    return fixture_config(*overrides).to_dict()


FORMAT_1 = {
    "format_version": 1,
    "train_state": {"iteration": 4, "consumed_samples": 32},
    "layout": {"world_size": 1, "tensor": 1, "pipeline": 1, "virtual": 1, "expert": 1},
    "config": {
        "model": {"num_layers": 2, "hidden_size": 16, "swiglu": True},
        "moe": {"num_experts": 4, "ffn_hidden_size": 16, "topk": 2, "router_type": "top_p",
                "score_function": "softmax", "top_p_threshold": 0.5, "num_groups": 2,
                "sinkhorn_tolerance": 1e-3, "balancing": "aux_loss", "aux_loss_coeff": 0.02,
                "capacity_factor": 1.25, "dispatcher": "allgather",
                "shared_expert_ffn_size": 32, "activation": "swiglu",
                "layer_overrides": {1: {"router_type": "topk", "num_groups": 2,
                                        "groups_per_token": 1, "top_p_threshold": 0.3,
                                        "z_loss_coeff": 0.001}}},
        "guards": {"nonfinite": True, "spike_factor": 10.0, "debug_nan_step": 0,
                   "debug_nan_param": "decoder.layers.1.mlp.experts", "debug_spike_step": 0},
    },
}
FORMAT_1_AS_TREE = {
    "num_experts": 4, "ffn_hidden_size": 16, "topk": 2,
    "router": {"kind": "top_p", "score_function": "softmax", "threshold": 0.5},
    "balancing": {"methods": "aux_loss", "aux_loss_coeff": 0.02},
    "dispatcher": {"kind": "allgather", "capacity_factor": 1.25},
    "shared_expert": {"ffn_hidden_size": 32}, "experts": {"activation": "swiglu"},
    # the override picks another router: the section's common router settings stay with it
    "layer_overrides": {1: {"router": {"kind": "topk", "score_function": "softmax",
                                       "num_groups": 2, "groups_per_token": 1},
                            "balancing": {"z_loss_coeff": 0.001}}},
}


def test_checkpoints_are_written_in_format_2_and_the_fixtures_are_format_1():
    assert checkpoint_schema.FORMAT_VERSION == 2
    assert len(FOLDERS) == 2
    for folder in FOLDERS:
        assert load_common_state(folder)["format_version"] == 1


def test_upgrade_1_nests_the_moe_settings_and_drops_what_had_no_effect():
    common = upgraded(FORMAT_1, HERE)
    assert common["format_version"] == 2
    assert common["config"]["moe"] == FORMAT_1_AS_TREE
    assert common["config"]["guards"] == {"nonfinite": True, "spike_factor": 10.0}
    assert common["config"]["model"] == FORMAT_1["config"]["model"]
    assert common["train_state"] == FORMAT_1["train_state"]
    assert FORMAT_1["config"]["moe"]["router_type"] == "top_p"  # the input is left as it was


@pytest.mark.parametrize("config", [None, "model", {"model": {}, "moe": 3},
                                    {"model": {}, "moe": {"layer_overrides": 5}},
                                    {"model": {}, "moe": {"router": 7}}])
def test_upgrade_1_leaves_malformed_settings_for_the_reader_to_refuse(config):
    common = upgraded({**FORMAT_1, "config": config}, HERE)
    with pytest.raises(CheckpointError, match="ckpt"):
        check_compatible(common["config"], fixture_config(), HERE)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.parts[-3])
def test_the_format_1_fixtures_resume_under_their_own_config(folder):
    state, layout = interpret_common_state(load_common_state(folder), fixture_config(), folder)
    assert state.iteration == 4 and layout is not None
    common = upgraded(load_common_state(folder), folder)
    assert check_compatible(common["config"], fixture_config(), folder) == []
    assert common["config"]["moe"] == {
        "num_experts": 4, "ffn_hidden_size": 16, "topk": 2,
        "router": {"score_function": "sigmoid"},
        "balancing": {"methods": "bias", "bias_update_rate": 0.01}, "layer_overrides": {}}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.parts[-3])
def test_changed_training_settings_are_returned_in_tree_order(folder):
    config = fixture_config("moe.balancing.aux_loss_coeff=0.02",
                            "moe.balancing.bias_update_rate=0.001",
                            "moe.dispatcher.kind=allgather", "model.hidden_dropout=0.1",
                            "moe.balancing.bias_update_schedule=[[6, 0.0]]")
    common = upgraded(load_common_state(folder), folder)
    assert check_compatible(common["config"], config, folder) == [
        SettingChange("model.hidden_dropout", 0.0, 0.1),
        SettingChange("moe.dispatcher.kind", "alltoall", "allgather"),
        SettingChange("moe.balancing.aux_loss_coeff", 0.01, 0.02),
        SettingChange("moe.balancing.bias_update_rate", 0.01, 0.001),
        SettingChange("moe.balancing.bias_update_schedule", [], [[6, 0.0]])]


@pytest.mark.parametrize("override, message", [
    ("moe.num_experts=8", r"moe\.num_experts=4 but the config says 8; moe\.num_experts is a "
                          "model setting"),
    ("moe.router.score_function=softmax", r"moe\.router\.score_function='sigmoid' but the "
                                          "config says 'softmax'"),
    ("model.num_layers=3", r"model\.num_layers=2 but the config says 3"),
])
def test_a_changed_model_setting_refuses_by_name(override, message):
    folder = FOLDERS[0]
    with pytest.raises(CheckpointError, match=message):
        interpret_common_state(load_common_state(folder), fixture_config(override), folder)


def test_a_changed_router_kind_is_named_before_the_settings_of_either_router():
    saved = saved_config("moe.balancing.methods=aux_loss", "moe.router.kind=threshold",
                         "moe.router.ema_decay=0.9")
    config = fixture_config("moe.balancing.methods=aux_loss", "moe.router.kind=top_p",
                            "moe.router.score_function=softmax")
    with pytest.raises(CheckpointError, match=r"moe\.router\.kind='threshold' but the config "
                                              r"says 'top_p'"):
        check_compatible(saved, config, HERE)


def test_a_setting_of_the_saved_kind_only_takes_that_kind_s_role():
    """The threshold router's ema_decay (a training setting) is absent from another router's
    tree: with the kind unchanged it is compared as the training setting it is."""
    threshold = ("moe.balancing.methods=aux_loss", "moe.router.kind=threshold")
    saved = saved_config(*threshold, "moe.router.ema_decay=0.9")
    assert check_compatible(saved, fixture_config(*threshold), HERE) == [
        SettingChange("moe.router.ema_decay", 0.9, 0.99)]


def test_layer_overrides_take_the_role_of_the_setting_they_override():
    layer = "moe.layer_overrides={1: {balancing: {aux_loss_coeff: 0.05}}}"
    saved = saved_config("moe.balancing.methods=aux_loss", layer)
    assert check_compatible(saved, fixture_config("moe.balancing.methods=aux_loss"), HERE) == [
        SettingChange("moe.layer_overrides.1.balancing.aux_loss_coeff", 0.05, 0.01)]
    with pytest.raises(CheckpointError, match=r"moe\.layer_overrides\.1\.topk=2 but the config "
                                              "says 1"):
        check_compatible(saved, fixture_config(
            "moe.balancing.methods=aux_loss",
            "moe.layer_overrides={1: {topk: 1, balancing: {aux_loss_coeff: 0.05}}}"), HERE)


def test_a_setting_the_checkpoint_does_not_record_reads_as_its_default():
    saved = saved_config()
    del saved["model"]["qk_layernorm"]
    del saved["moe"]["router"]["gate_logit_norm"]
    assert check_compatible(saved, fixture_config(), HERE) == []
    with pytest.raises(CheckpointError, match=r"model\.qk_layernorm=False \(its default: the "
                                              r"checkpoint does not record it\) but the config "
                                              "says True"):
        check_compatible(saved, fixture_config("model.qk_layernorm=true"), HERE)


def test_an_unknown_saved_setting_refuses_by_name():
    saved = saved_config()
    saved["moe"]["router"]["retired_knob"] = 1
    with pytest.raises(CheckpointError, match=r"moe\.router\.retired_knob"):
        check_compatible(saved, fixture_config(), HERE)


def test_init_from_a_converter_s_record_announces_only_the_settings_it_records():
    """A converter (tools/upcycle_ckpt.py, tools/import_hf.py) records the settings it chose;
    its model never trained with the others, so only a change of a recorded one is announced.
    A training checkpoint's saved config announces every change."""
    sections = {"model": saved_config()["model"],
                "moe": {"num_experts": 4, "ffn_hidden_size": 16, "topk": 2,
                        "router": {"score_function": "sigmoid"},
                        "balancing": {"methods": "bias", "aux_loss_coeff": 0.05}}}
    changed = SettingChange("moe.balancing.aux_loss_coeff", 0.05, 0.01)
    assert training_changes(sections, fixture_config(), HERE, recorded_only=True) == [changed]
    assert training_changes(sections, fixture_config(), HERE) == [
        changed, SettingChange("moe.balancing.bias_update_rate", 0.001, 0.01)]


def test_upgrades_run_from_the_saved_format(monkeypatch):
    """A format-3 megamoe that renamed a setting reads format-1 checkpoints through both
    upgrades, and refuses a newer format."""
    folder = FOLDERS[0]

    def rename_swiglu(common):
        model = dict(common["config"]["model"])
        model["gated_mlp"] = model.pop("swiglu")
        return {**common, "config": {**common["config"], "model": model}}

    monkeypatch.setattr(checkpoint_schema, "FORMAT_VERSION", 3)
    monkeypatch.setitem(checkpoint_schema.UPGRADES, 2, rename_swiglu)
    common = upgraded(load_common_state(folder), folder)
    assert common["format_version"] == 3
    assert "gated_mlp" in common["config"]["model"] and "swiglu" not in common["config"]["model"]
    assert common["config"]["moe"]["balancing"] == {"methods": "bias", "bias_update_rate": 0.01}
    with pytest.raises(CheckpointError, match="has checkpoint format 4; this megamoe reads "
                                              "formats 1..3"):
        upgraded({**common, "format_version": 4}, folder)


def test_a_changed_setting_is_announced_and_recorded(tmp_path, capsys):
    config = fixture_config(f"output_dir={tmp_path}", "logging.progress_bar=false",
                            "logging.tensorboard=false")
    logger = MetricsLogger(config, active=True, start_step=4)
    logger.setting_changed(5, "moe.balancing.aux_loss_coeff", 0.01, 0.02)
    logger.close()
    assert capsys.readouterr().out == ("setting moe.balancing.aux_loss_coeff: 0.01 -> 0.02 "
                                       "(from step 5)\n")
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {key: record[key] for key in ("step", "event", "setting", "old", "new")} == {
        "step": 5, "event": "setting", "setting": "moe.balancing.aux_loss_coeff", "old": 0.01,
        "new": 0.02}
