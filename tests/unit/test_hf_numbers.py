"""Numbers from a Hugging Face config.json reach megamoe exactly as given (issue 46, item 6): a
fractional or huge `rope_theta` is the float it was (never `int(theta)`: 10000.9 became 10000,
0.5 became 0, 1e300 a 301-digit integer the trainer refused), the trainer takes what the
importer writes, and a value that is not a number is one line. The reference for the end-to-end
case is transformers' own logits (`tools/import_hf.py --verify`)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from hf_models import save_tiny_hf_model

from megamoe.checkpointing.hf_arch import megatron_lm_rotary_base, parse_hf_arch
from megamoe.errors import CheckpointError
from megamoe.train.config import config_from_dict
import warm_launcher

REPO = Path(__file__).resolve().parents[2]
LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, vocab_size=256, rms_norm_eps=1e-5)


@pytest.mark.parametrize("theta", [10000.9, 0.5, 1e300, 500000.0, 500000])
def test_rope_theta_is_kept_exactly_and_the_trainer_takes_it(theta):
    settings = parse_hf_arch({**LLAMA, "rope_theta": theta}, Path("config.json"), False,
                             False).model_settings()
    assert settings["rotary_base"] == theta and isinstance(settings["rotary_base"], float)
    config = config_from_dict({"model": {**settings, "num_layers": 2},
                               "moe": {"num_experts": 2, "ffn_hidden_size": 64}})
    assert config.model.rotary_base == theta
    # the YAML the importer writes reads back to the same float
    assert yaml.safe_load(yaml.safe_dump({"b": settings["rotary_base"]}))["b"] == theta


def test_megatron_lm_flag_value_is_an_int_only_when_exact():
    assert megatron_lm_rotary_base(500000.0) == 500000
    assert isinstance(megatron_lm_rotary_base(500000.0), int)
    assert megatron_lm_rotary_base(10000.9) == 10000.9
    assert megatron_lm_rotary_base(1e300) == 1e300 and isinstance(megatron_lm_rotary_base(1e300),
                                                                  float)


@pytest.mark.parametrize("field, value", [
    ("rope_theta", "10000"), ("rope_theta", True), ("rope_theta", 0), ("rope_theta", -1.5),
    ("rms_norm_eps", "1e-5"),
    ("rope_scaling", {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
])
def test_a_setting_that_is_not_a_positive_number_is_one_line(field, value):
    with pytest.raises(CheckpointError, match=field.split("_scaling")[0]) as err:
        parse_hf_arch({**LLAMA, field: value}, Path("config.json"), False, False)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_fractional_rope_theta_imports_and_matches_transformers(tmp_path):
    """rope_theta 0.5 (int() made it 0, and the model NaN): the import's logits equal
    transformers' within the tool's bar, and train_config.yaml holds 0.5."""
    hf = save_tiny_hf_model("mixtral", tmp_path / "hf", rope_theta=0.5, tokenizer=True)
    done = warm_launcher.run([sys.executable, "tools/import_hf.py", "--load", str(hf), "--save",
                              str(tmp_path / "out"), "--verify", "--no-progress"], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max |logit diff| transformers vs megamoe" in done.stdout
    written = yaml.safe_load((tmp_path / "out" / "train_config.yaml").read_text())
    assert written["model"]["rotary_base"] == 0.5
