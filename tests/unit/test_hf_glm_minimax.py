"""GLM-4.5's and MiniMax-M2's config tables (megamoe.checkpointing.hf.glm4_moe, minimax_m2)
without weights: the config.json the export writes from trained settings reads back as the same
model and makes transformers build the same model as the source's; hostile values are one-line
refusals naming the field; the export refuses what each architecture cannot express. (Weights,
logits and round trips: tests/distributed/test_hf_import.py.)"""
import json

import pytest

pytest.importorskip("transformers")
from hf_models import ARCHS, BASE  # noqa: E402

from megamoe.checkpointing.hf import read_hf_moe_model  # noqa: E402
from megamoe.errors import CheckpointError, ConfigError  # noqa: E402
from megamoe.interop.hf_config import generated_config  # noqa: E402
from megamoe.interop.hf_export import check_expressible  # noqa: E402
from megamoe.train.config import config_from_dict  # noqa: E402

VARIANTS = {  # name: (architecture, config fields over the tiny test model's)
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe_air_like": ("glm4_moe", dict(partial_rotary_factor=0.25, attention_bias=False,
                                          use_qk_norm=False, n_group=1, topk_group=1,
                                          first_k_dense_replace=0, n_shared_experts=2)),
    "minimax_m2": ("minimax_m2", {}),
}


def source_config(arch: str, directory, **fields):
    """The tiny test model's config.json as transformers saves it (no weights)."""
    from transformers import AutoConfig

    AutoConfig.for_model(arch, **{**BASE, **ARCHS[arch], **fields}).save_pretrained(
        str(directory))
    return directory


def write(directory, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_written_config_reads_back_and_transformers_builds_the_same_model(variant, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, fields = VARIANTS[variant]
    source = source_config(arch, tmp_path / "source", **fields)
    model = read_hf_moe_model(source)
    sections = model.train_sections()
    config = config_from_dict(sections)
    written = generated_config(arch, config, list(model.moe.pattern), BASE["vocab_size"],
                               BASE["max_position_embeddings"], model.mtp_layers)
    out = write(tmp_path / "out", written)
    assert read_hf_moe_model(out).train_sections() == sections
    theirs, ours = (AutoConfig.from_pretrained(str(d)) for d in (source, out))
    assert ours.rope_parameters == theirs.rope_parameters
    shapes = [{name: tuple(value.shape) for name, value in
               AutoModelForCausalLM.from_config(c).state_dict().items()} for c in (theirs, ours)]
    assert shapes[0] == shapes[1]


def _with(config: dict, field: str, value) -> dict:
    """config.json with `field` set; the rotary fraction where transformers 5 keeps it."""
    config = json.loads(json.dumps(config))
    if field in ("partial_rotary_factor", "rotary_dim"):
        config["rope_parameters"].pop("partial_rotary_factor")
    config[field] = value
    return config


@pytest.mark.parametrize("arch, field, value", [
    ("glm4_moe", "partial_rotary_factor", 0.3),  # 9.6 -> 9 channels, odd
    ("glm4_moe", "partial_rotary_factor", 1.5),
    ("glm4_moe", "partial_rotary_factor", "half"),
    ("glm4_moe", "n_group", 3),
    ("glm4_moe", "first_k_dense_replace", 2),
    ("glm4_moe", "norm_topk_prob", False),
    ("glm4_moe", "use_qk_norm", "yes"),
    ("glm4_moe", "num_nextn_predict_layers", 10 ** 6),
    ("minimax_m2", "rotary_dim", 33),
    ("minimax_m2", "rotary_dim", 0),
    ("minimax_m2", "qk_norm_type", "per_head"),
    ("minimax_m2", "scoring_func", "softmax"),
    ("minimax_m2", "num_experts_per_tok", 1),
    ("minimax_m2", "num_experts_per_tok", 9),
    ("minimax_m2", "attention_bias", True),
])
def test_hostile_values_are_one_line_refusals(arch, field, value, tmp_path):
    config = json.loads((source_config(arch, tmp_path / "source") / "config.json").read_text())
    with pytest.raises(CheckpointError) as error:
        read_hf_moe_model(write(tmp_path / "bad", _with(config, field, value)))
    message = str(error.value)
    assert "\n" not in message and field in message, message


PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.mark.parametrize("arch, fields, other, names", [
    ("glm4_moe", {}, "minimax_m2", "qk_layernorm"),  # per-head QK norm
    ("minimax_m2", {}, "glm4_moe", "qk_layernorm_scope"),
    ("minimax_m2", {}, "mixtral", "model.rotary_percent"),
    ("deepseek_v3", PLAIN_ROPE, "glm4_moe", "multi-head latent attention"),
])
def test_export_refuses_what_the_architecture_cannot_express(arch, fields, other, names,
                                                             tmp_path):
    model = read_hf_moe_model(source_config(arch, tmp_path / "source", **fields))
    config = config_from_dict(model.train_sections())
    check_expressible(arch, config, list(model.moe.pattern))
    with pytest.raises(ConfigError, match=f"--arch {other} cannot express") as error:
        check_expressible(other, config, list(model.moe.pattern))
    assert names in str(error.value) and "\n" not in str(error.value)
