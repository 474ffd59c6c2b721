"""GPT-OSS's two-way table (megamoe.checkpointing.hf.gpt_oss): its layout transforms against
transformers' own reading of the fused tensors, exact inverses, and config.json read into
megamoe's settings, hostile values refused in one line naming the field. The whole model in and
out (import --verify, EP=2, training, export, round trip) is in
tests/distributed/test_hf_import.py."""
from __future__ import annotations

import json

import pytest
import torch

from megamoe.checkpointing.hf import read_hf_moe_model
from megamoe.checkpointing.hf.gpt_oss import GateUpColumns, Transposed
from megamoe.errors import CheckpointError
import warm_launcher

E, H, F = 3, 8, 5


def test_fused_gate_up_is_megatrons_gate_then_up_rows_and_back_bit_identical():
    """transformers' GptOssExperts reads gate = gate_up[..., ::2], up = gate_up[..., 1::2] of
    x @ gate_up_proj[e]; Megatron's fc1 [2F, H] computes fc1 @ x with rows [gate; up]."""
    torch.manual_seed(0)
    gate_up, bias, down = torch.randn(E, H, 2 * F), torch.randn(E, 2 * F), torch.randn(E, F, H)
    fc1 = GateUpColumns(transposed=True).to_megatron([gate_up])
    fc1_bias = GateUpColumns(transposed=False).to_megatron([bias])
    fc2 = Transposed().to_megatron([down])
    x, y = torch.randn(H), torch.randn(F)
    for e in range(E):
        fused = x @ gate_up[e] + bias[e]
        ours = fc1[e] @ x + fc1_bias[e]
        torch.testing.assert_close(ours[:F], fused[0::2])
        torch.testing.assert_close(ours[F:], fused[1::2])
        torch.testing.assert_close(fc2[e] @ y, y @ down[e])  # transformers: act @ down_proj
    assert fc1.shape == (E, 2 * F, H) and fc1.is_contiguous() and fc2.shape == (E, H, F)
    for transform, megatron, original in ((GateUpColumns(True), fc1, gate_up),
                                          (GateUpColumns(False), fc1_bias, bias),
                                          (Transposed(), fc2, down)):
        back, = transform.to_hf(megatron, [tuple(original.shape)])
        assert torch.equal(back, original) and back.is_contiguous()


def gpt_oss_config(directory, **fields):
    """A tiny GPT-OSS config.json (the config reader needs no weights)."""
    from transformers import AutoConfig

    from hf_models import ARCHS, BASE

    directory.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model("gpt_oss", **{**BASE, **ARCHS["gpt_oss"]}).to_dict()
    (directory / "config.json").write_text(json.dumps({**config, **fields}))
    return directory


def test_config_reads_into_megamoes_settings(tmp_path):
    sections = read_hf_moe_model(gpt_oss_config(tmp_path, num_hidden_layers=4,
                                                layer_types=["sliding_attention",
                                                             "full_attention"] * 2)
                                 ).train_sections()
    model, moe = sections["model"], sections["moe"]
    assert moe["experts"] == {"activation": "clamped_swiglu", "swiglu_limit": 1.0, "bias": True}
    assert moe["router"]["bias"] and moe["router"]["score_function"] == "softmax"
    assert not moe["router"]["pre_softmax"] and moe["topk"] == 2 and moe["num_experts"] == 4
    assert (model["add_qkv_bias"], model["add_bias_linear"], model["attention_sinks"]) == (
        True, True, True)
    assert (model["sliding_window"], model["sliding_window_layers"]) == (8, [1, 0, 1, 0])
    assert model["yarn"]["truncate"] is False and model["yarn"]["factor"] == 4.0
    assert model["rotary_base"] == 150000.0 and model["kv_channels"] == 16


@pytest.mark.parametrize("fields, message", [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5 is not supported"),
    ({"swiglu_limit": -7.0}, "swiglu_limit=-7.0 must be a positive"),
    ({"swiglu_limit": "7"}, "swiglu_limit='7' must be a positive number"),
    ({"layer_types": ["sliding_attention"]}, "layer_types=['sliding_attention'] must list"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types="),
    ({"sliding_window": None}, "sliding_window=None is not supported"),
    ({"sliding_window": -1}, "sliding_window=-1 must be a whole number"),
    ({"num_local_experts": 0}, "num_local_experts=0 must be a whole number"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds the 4 routed experts"),
    ({"attention_bias": "yes"}, "attention_bias='yes' must be true or false"),
])
def test_hostile_config_values_are_refused_in_one_line(tmp_path, fields, message):
    with pytest.raises(CheckpointError) as err:
        read_hf_moe_model(gpt_oss_config(tmp_path, **fields))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_exported_config_is_transformers_gpt_oss_and_reads_back_as_the_same_model(tmp_path):
    """write_config of a model's settings (what an export from a checkpoint trained from scratch
    writes) reads back into the same megamoe settings, and transformers reads from it the
    source's layer types, window, YaRN parameters (untruncated) and expert settings."""
    from transformers import AutoConfig

    from megamoe.interop.hf_config import generated_config
    from megamoe.train.config import config_from_dict

    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    source = gpt_oss_config(tmp_path / "source", num_hidden_layers=4, layer_types=types)
    sections = read_hf_moe_model(source).train_sections()
    config = config_from_dict({**sections, "output_dir": str(tmp_path / "run")})
    written = generated_config("gpt_oss", config, [True] * 4, vocab_size=4096, context=256)
    (tmp_path / "back").mkdir()
    (tmp_path / "back" / "config.json").write_text(json.dumps(written))
    again = read_hf_moe_model(tmp_path / "back").train_sections()
    assert (again["model"], again["moe"]) == (sections["model"], sections["moe"])
    ours, theirs = (AutoConfig.from_pretrained(folder) for folder in (tmp_path / "back", source))
    assert type(ours).__name__ == "GptOssConfig" and ours.layer_types == types
    for key in ("sliding_window", "rope_parameters", "swiglu_limit", "swiglu_alpha",
                "attention_bias", "num_local_experts", "num_experts_per_tok", "head_dim",
                "intermediate_size", "router_aux_loss_coef"):
        assert getattr(ours, key) == getattr(theirs, key), key


@pytest.mark.slow
def test_the_import_tool_refuses_in_one_line_with_exit_2_and_writes_nothing(tmp_path):
    import sys
    from pathlib import Path

    source = gpt_oss_config(tmp_path / "hf", swiglu_alpha=1.5)
    done = warm_launcher.run([sys.executable, "tools/import_hf.py", "--load", str(source),
                              "--save", str(tmp_path / "out"), "--no-progress"],
                             cwd=Path(__file__).resolve().parents[2], capture_output=True,
                             text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "swiglu_alpha=1.5 is not supported" in lines[0]
    assert not (tmp_path / "out").exists()


RELEASED_120B = {  # https://huggingface.co/openai/gpt-oss-120b config.json, as it ships
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088}


def test_the_released_120b_config_reads_as_gpt_oss(tmp_path):
    """The release's own config.json (legacy rope_scaling spelling, MXFP4 quantisation): every
    layer MoE, 128 experts top-4, window 128 on even layers, YaRN x32 over 4096 untruncated."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_120B))
    model = read_hf_moe_model(tmp_path)
    sections = model.train_sections()
    m, moe = sections["model"], sections["moe"]
    assert model.moe.pattern == (True,) * 36 and (moe["num_experts"], moe["topk"]) == (128, 4)
    assert (m["num_attention_heads"], m["num_query_groups"], m["kv_channels"]) == (64, 8, 64)
    assert m["sliding_window"] == 128 and m["sliding_window_layers"] == [1, 0] * 18
    assert m["yarn"] == {"factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    assert m["rotary_base"] == 150000 and moe["experts"]["swiglu_limit"] == 7.0
    assert moe["balancing"]["aux_loss_coeff"] == 0.9
