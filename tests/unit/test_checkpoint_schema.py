"""The versioned schema of megamoe's training checkpoints, on the committed checkpoints of today's
format (tests/fixtures/mcore_checkpoints, written by megamoe under megatron-core 0.16.1 and
0.19.2): they stay readable, a setting added later reads as its default, a setting that would
change the model refuses by name, and upgrades run from the saved format to the current one."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megamoe import CheckpointError
from megamoe.checkpointing.safe_dcp import load_common_state
from megamoe.train import checkpoint_schema
from megamoe.train.checkpoint import interpret_common_state
from megamoe.train.config import ModelConfig, load_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mcore_checkpoints"
FOLDERS = sorted(FIXTURES.glob("mcore-*/checkpoints/iter_*"))


def fixture_config(*overrides: str):
    data = FIXTURES / "data" / "synthetic"
    return load_config(str(FIXTURES / "config.yaml"),
                       [f"data.prefixes=[{data}]", f"data.tokenizer_model={data}.model",
                        *overrides])


@dataclasses.dataclass
class NewerModelConfig(ModelConfig):
    """ModelConfig as a later megamoe might have it: one more architecture setting."""

    attention_sinks: int = 0


def with_newer_model(config, value: int, monkeypatch):
    monkeypatch.setattr(checkpoint_schema, "ModelConfig", NewerModelConfig)
    config.model = NewerModelConfig(**dataclasses.asdict(config.model), attention_sinks=value)
    return config


def test_there_are_checkpoints_of_todays_format():
    assert len(FOLDERS) == 2
    for folder in FOLDERS:
        assert load_common_state(folder)["format_version"] == checkpoint_schema.FORMAT_VERSION


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.parts[-3])
def test_todays_checkpoints_resume_under_the_current_schema(folder):
    state, layout = interpret_common_state(load_common_state(folder), fixture_config(), folder)
    assert state.iteration == 4 and layout is not None


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.parts[-3])
def test_a_setting_added_later_reads_as_its_default(folder, monkeypatch):
    config = with_newer_model(fixture_config(), 0, monkeypatch)
    state, _ = interpret_common_state(load_common_state(folder), config, folder)
    assert state.iteration == 4


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.parts[-3])
def test_a_new_setting_that_changes_the_model_refuses_by_name(folder, monkeypatch):
    config = with_newer_model(fixture_config(), 2, monkeypatch)
    with pytest.raises(CheckpointError, match=r"model\.attention_sinks=0 \(its default: the "
                                              r"checkpoint predates it\) but the config says 2"):
        interpret_common_state(load_common_state(folder), config, folder)


def test_a_written_default_equals_an_unwritten_one():
    folder = FOLDERS[0]
    default_topk = checkpoint_schema.section_defaults("moe")["topk"]
    config = fixture_config()
    assert "topk" not in config.moe or config.moe["topk"] == default_topk
    config.moe = {**config.moe, "topk": default_topk}
    interpret_common_state(load_common_state(folder), config, folder)


def test_a_changed_setting_refuses_by_name():
    folder = FOLDERS[0]
    config = fixture_config("model.num_layers=3")
    with pytest.raises(CheckpointError, match=r"model\.num_layers=\d+ but the config says 3"):
        interpret_common_state(load_common_state(folder), config, folder)


def test_an_unknown_saved_setting_refuses_by_name():
    folder = FOLDERS[0]
    common = load_common_state(folder)
    common["config"]["model"]["retired_knob"] = 1
    with pytest.raises(CheckpointError, match=r"model\.retired_knob, a setting this megamoe does "
                                              "not know"):
        interpret_common_state(common, fixture_config(), folder)


def test_upgrades_run_from_the_saved_format(monkeypatch):
    """A format-2 megamoe that renamed a setting reads today's checkpoints through its upgrade."""
    folder = FOLDERS[0]

    def rename_swiglu(common):
        model = dict(common["config"]["model"])
        model["gated_mlp"] = model.pop("swiglu")
        return {**common, "config": {**common["config"], "model": model}}

    monkeypatch.setattr(checkpoint_schema, "FORMAT_VERSION", 2)
    monkeypatch.setattr(checkpoint_schema, "UPGRADES", {1: rename_swiglu})
    common = checkpoint_schema.upgraded(load_common_state(folder), folder)
    assert common["format_version"] == 2
    assert "gated_mlp" in common["config"]["model"] and "swiglu" not in common["config"]["model"]
    newer = {**common, "format_version": 3}
    with pytest.raises(CheckpointError, match="has checkpoint format 3; this megamoe reads "
                                              "formats 1..2"):
        checkpoint_schema.upgraded(newer, folder)
