"""Hugging Face interop: dense HF models (Llama, Mistral, Qwen2, Qwen3) upcycled into megamoe
MoE checkpoints, megamoe MoE checkpoints exported as Mixtral/Qwen2-MoE/Qwen3-MoE, bad input.

The reference is always transformers' own model code (`AutoModelForCausalLM`, fp32 CPU): the
upcycled megamoe model must reproduce the dense HF model's logits, and the exported HF model
the megamoe checkpoint's, within 1e-4.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from hf_models import save_tiny_hf_model  # noqa: E402

from megamoe.checkpointing.hf_source import interleave_qkv, split_qkv, HFArch
from megamoe.errors import MegaMoEError  # noqa: E402
from megamoe.interop.hf_export import check_expressible, export_hf  # noqa: E402
from megamoe.ownership import MARK, outside_mark, owner  # noqa: E402
from megamoe.train.config import config_from_dict  # noqa: E402
from megamoe.upcycle import UpcycleRecipe, upcycle_checkpoint  # noqa: E402
import warm_launcher

REPO = Path(__file__).resolve().parents[2]
BAR = 1e-4
QUIET = dict(progress=False, log=lambda line: None)


def _upcycle(hf: Path, out: Path, verify: bool = True, **recipe):
    recipe = UpcycleRecipe(**{"num_experts": 4, "topk": 2, **recipe})
    return upcycle_checkpoint(hf, out, recipe, verify=verify, **QUIET)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_upcycled_hf_model_reproduces_transformers_logits(arch, tmp_path):
    hf = save_tiny_hf_model(arch, tmp_path / "hf")
    result = _upcycle(hf, tmp_path / "moe")
    assert result.max_logit_diff <= BAR
    assert (tmp_path / "moe" / "train_config.yaml").is_file()


@pytest.mark.slow
def test_granular_shared_gated_upcycle_and_qwen2_moe_export(tmp_path):
    """Qwen2 (QKV bias, tied embeddings) -> dense layer 0, MoE layer 1 with 8 experts of half
    size and a gated shared expert -> Qwen2-MoE (mlp_only_layers, shared_expert_gate)."""
    hf = save_tiny_hf_model("qwen2", tmp_path / "hf")
    result = _upcycle(hf, tmp_path / "moe", num_experts=8, topk=4, granularity=2,
                      shared_expert=True, shared_expert_gate=True, moe_layers=(1,))
    assert result.max_logit_diff <= BAR
    exported = export_hf(tmp_path / "moe", tmp_path / "out", verify=True, log=lambda line: None)
    assert exported.arch == "qwen2_moe" and exported.max_logit_diff <= BAR
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["mlp_only_layers"] == [0] and config["num_experts"] == 8


@pytest.mark.parametrize("arch, target", [("llama", "mixtral"), ("qwen3", "qwen3_moe")])
def test_export_matches_megamoe_logits(arch, target, tmp_path):
    hf = save_tiny_hf_model(arch, tmp_path / "hf")
    _upcycle(hf, tmp_path / "moe", verify=False)
    exported = export_hf(tmp_path / "moe", tmp_path / "out", arch=target, verify=True,
                         max_shard_bytes=200_000, log=lambda line: None)
    assert exported.max_logit_diff <= BAR
    assert len(exported.shards) > 1  # streamed into several shards
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(exported.shards)
    # only what transformers and the Hub expect: the ownership mark lies beside the folder
    assert not any(path.name == MARK for path in (tmp_path / "out").rglob("*"))
    assert owner(tmp_path / "out") == "export_hf" and outside_mark(tmp_path / "out").is_file()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_conversion_then_megatron_upcycle(arch, tmp_path):
    """HF -> dense Megatron-Core checkpoint (verified against transformers), which the Megatron
    path then upcycles with its own --verify (Megatron-Core dense vs MoE, args from the
    conversion)."""
    from megamoe.interop.hf_dense import convert_hf_dense

    hf = save_tiny_hf_model(arch, tmp_path / "hf")
    assert convert_hf_dense(hf, tmp_path / "dense", verify=True, log=lambda line: None) <= BAR
    assert _upcycle(tmp_path / "dense", tmp_path / "moe").max_logit_diff <= BAR


def test_qkv_interleave_is_megatrons_grouped_layout():
    """Megatron splits fused QKV rows per key/value group: [q heads of g, k of g, v of g]."""
    arch = HFArch("llama", 1, 8, 4, 2, 2, 8, 10, 1e4, None, 1e-5, False, False, False, 8)
    q, k, v = (torch.arange(n * 8.).reshape(n, 8) + offset
               for n, offset in ((8, 0), (4, 1000), (4, 2000)))
    fused = interleave_qkv(q, k, v, groups=2)
    # group 0: q heads 0,1 (rows 0-3), k head 0 (rows 0-1), v head 0 (rows 0-1)
    assert torch.equal(fused[:4], q[:4]) and torch.equal(fused[4:6], k[:2])
    assert torch.equal(fused[6:8], v[:2]) and torch.equal(fused[8:12], q[4:])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, arch), (q, k, v)))


def _config(**moe):
    base = {"num_experts": 4, "ffn_hidden_size": 32, "topk": 2}
    return config_from_dict({"model": {"position_embedding": "rope"}, "moe": {**base, **moe}})


@pytest.mark.parametrize("moe, arch, phrase", [
    ({"router": {"score_function": "sigmoid"}}, "mixtral", "score_function='sigmoid'"),
    ({"router": {"num_groups": 2, "groups_per_token": 1}}, "mixtral", "group-limited"),
    ({"router": {"kind": "top_p"}}, "qwen3_moe", "router.kind='top_p'"),
    ({"router": {"pre_softmax": True}}, "mixtral", "renormalisation"),
    ({"dispatcher": {"capacity_factor": 1.0}}, "mixtral", "capacity_factor"),
    ({}, "qwen2_moe", "gated shared expert"),
])
def test_export_refuses_what_the_architecture_cannot_express(moe, arch, phrase):
    with pytest.raises(MegaMoEError, match=phrase):
        check_expressible(arch, _config(**moe), [True] * 4)


def test_export_refuses_dense_first_layers_for_mixtral():
    with pytest.raises(MegaMoEError, match="dense layers"):
        check_expressible("mixtral", _config(), [False, True, True, True])


# ---- the exported config.json and the imported train_config.yaml ---------------------------

def test_a_model_megamoe_made_exports_its_real_context_rope_ids_and_aux_weight():
    """No source config (trained from scratch): transformers reads the context it was trained
    for (not max(seq_length, 4096)), its Llama 3 rope scaling with Megatron-Core's constants
    (Megatron's `_apply_scaling`: factor, 1, 4, 8192), the tokenizer's bos/eos/pad and the
    weight of its balance loss; DeepSeek-V3 with YaRN the context YaRN extends to."""
    from transformers import AutoConfig

    from megamoe.interop.hf_config import exported_configs

    config = config_from_dict({
        "model": {"position_embedding": "rope", "seq_length": 512, "rope_scaling_factor": 8.0,
                  "num_layers": 2},
        "moe": {"num_experts": 4, "ffn_hidden_size": 32, "topk": 2,
                "balancing": {"aux_loss_coeff": 0.02}}})
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    out = exported_configs("mixtral", config, [True, True], 4096, "float32", None, ids)
    read = AutoConfig.for_model(**out.config)
    assert read.max_position_embeddings == 512 and read.router_aux_loss_coef == 0.02
    assert (read.bos_token_id, read.eos_token_id, read.pad_token_id) == (1, 2, None)
    assert read.rope_parameters == {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}
    assert json.loads(out.generation) == {"bos_token_id": 1, "eos_token_id": 2}
    yarn = config_from_dict({
        "model": {"position_embedding": "rope", "multi_latent_attention": True,
                  "num_layers": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_head_dim": 16,
                  "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "seq_length": 128,
                  "yarn": {"factor": 4.0, "original_max_position_embeddings": 256}},
        "moe": {"num_experts": 4, "ffn_hidden_size": 32, "topk": 2,
                "router": {"score_function": "sigmoid"},
                "balancing": {"methods": ["bias", "seq_aux_loss"]}}})
    out = exported_configs("deepseek_v3", yarn, [True, True], 4096, "float32", None, ids)
    assert AutoConfig.for_model(**out.config).max_position_embeddings == 1024


def test_what_the_import_dropped_is_the_one_change_named(tmp_path):
    """A DeepSeek-V3 imported without its multi-token-prediction layers and exported
    untrained: the source's config.json with num_nextn_predict_layers 0, named; nothing else."""
    from transformers import AutoConfig

    from hf_models import ARCHS, BASE
    from megamoe.checkpointing.hf import read_hf_moe_model
    from megamoe.interop.hf_config import exported_configs

    kept = tmp_path / "hf_source"
    AutoConfig.for_model("deepseek_v3", **{**BASE, **ARCHS["deepseek_v3"],
                                           "num_nextn_predict_layers": 1, "dtype": "float32"}
                         ).save_pretrained(kept)
    (kept / "conversion.json").write_text(json.dumps({"dropped_mtp_layers": 1}))
    model = read_hf_moe_model(kept)
    out = exported_configs("deepseek_v3", config_from_dict(model.train_sections()),
                           list(model.moe.pattern), 4096, "float32", kept, {})
    source = json.loads((kept / "config.json").read_text())
    assert out.config == {**source, "num_nextn_predict_layers": 0}
    assert out.changed == {"num_nextn_predict_layers": (1, 0)}
    assert "num_nextn_predict_layers 1 -> 0" in out.describe()


def test_train_config_caps_a_long_context_and_explains_each_choice():
    """A 32k-context Qwen3-MoE: train_config.yaml loads as a training config, trains at the CPU
    cap with a comment saying so, on the model's tokenizer and vocabulary, with the source's
    balancing (global-batch Switch loss, router_aux_loss_coef); every chosen setting has a
    comment, a nested setting one key a line with its note."""
    import yaml

    from megamoe.upcycle.train_recipe import (CPU_CONTEXT_CAP, ConvertedModel,
                                              continued_pretraining_settings, train_config_text)

    sections = {"model": {"num_layers": 2, "position_embedding": "rope"},
                "moe": {"num_experts": 4, "ffn_hidden_size": 32, "topk": 2,
                        "balancing": {"methods": "global_aux_loss", "aux_loss_coeff": 0.001}}}
    model = ConvertedModel("tools/import_hf.py", "a model", Path("/out"), 32768, 151936,
                           Path("/out/release/tokenizer"),
                           {"moe": {"balancing.methods": "as Qwen3 trained"}})
    text = train_config_text(sections, model)
    loaded = yaml.safe_load(text)
    config = config_from_dict(loaded)
    assert config.model.seq_length == CPU_CONTEXT_CAP < 32768
    assert (config.data.tokenizer, config.data.vocab_size) == ("/out/release/tokenizer", 151936)
    moe = config.moe_config()
    assert moe.balancing.methods == "global_aux_loss" and moe.balancing.aux_loss_coeff == 0.001
    assert config.checkpoint.init_from == "/out"
    lines = dict(line.strip().split(": ", 1) for line in text.splitlines()
                 if line.startswith("  ") and ": " in line)
    assert "capped at 512 for the CPU default" in lines["seq_length"]
    assert "  balancing:" in text.splitlines()
    assert lines["methods"].endswith("# as Qwen3 trained")
    for section in continued_pretraining_settings(model).values():
        assert all("  # " in lines[key] for key in section)
    # the peak's comment says a smoke run shows no learning and names overrides that do
    smoke = "optimizer.lr=1e-3 optimizer.warmup_steps=0"
    assert "no visible loss change" in lines["lr"] and smoke in lines["lr"]
    for override in smoke.split():
        key, value = override.removeprefix("optimizer.").split("=")
        loaded["optimizer"][key] = yaml.safe_load(value)
    loaded["training"]["train_steps"] = 10
    smoke_config = config_from_dict(loaded).optimizer
    assert (smoke_config.lr, smoke_config.warmup_steps) == (1e-3, 0)


# ---- bad input: one line, exit code 2, no output ------------------------------------------

def _break(kind: str, hf: Path) -> None:
    from safetensors.torch import load_file, save_file

    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    config_path = hf / "config.json"
    config = json.loads(config_path.read_text())
    if kind == "unknown_arch":
        config["model_type"] = "gpt_neox"
    elif kind == "already_moe":
        config.update(model_type="mixtral", num_local_experts=8)
    elif kind == "quantised_config":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    elif kind == "missing_shard":
        (hf / shards[-1]).unlink()
    elif kind == "mismatched_index":
        name = next(n for n, s in index["weight_map"].items() if s == shards[0])
        index["weight_map"][name] = shards[-1]
        index_path.write_text(json.dumps(index))
    elif kind == "int8_weights":
        tensors = load_file(str(hf / shards[0]))
        save_file({n: t.to(torch.int8) for n, t in tensors.items()}, str(hf / shards[0]),
                  metadata={"format": "pt"})
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize("kind, phrase", [
    ("unknown_arch", "unknown architecture"), ("already_moe", "already an MoE"),
    ("quantised_config", "quantised"), ("missing_shard", "is missing"),
    ("mismatched_index", "does not match"), ("int8_weights", "dtype I8"),
])
def test_bad_hf_input_is_one_line_and_leaves_nothing(kind, phrase, tmp_path):
    hf = save_tiny_hf_model("llama", tmp_path / "hf", num_hidden_layers=1)
    _break(kind, hf)
    with pytest.raises(MegaMoEError, match=phrase):
        _upcycle(hf, tmp_path / "moe", verify=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.slow
def test_cli_bad_input_exit_code_2(tmp_path):
    hf = save_tiny_hf_model("llama", tmp_path / "hf", num_hidden_layers=1)
    _break("missing_shard", hf)
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    for command in (["tools/upcycle_ckpt.py", "--load", str(hf), "--save", str(tmp_path / "o"),
                     "--num-experts", "4", "--topk", "2"],
                    ["tools/export_hf.py", "--load", str(hf), "--save", str(tmp_path / "o")]):
        done = warm_launcher.run([sys.executable, *command], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert not (tmp_path / "o").exists()
