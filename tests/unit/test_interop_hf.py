"""Hugging Face interop: dense HF models (Llama, Mistral, Qwen2, Qwen3) upcycled into megamoe
MoE checkpoints, megamoe MoE checkpoints exported as Mixtral/Qwen2-MoE/Qwen3-MoE, bad input.

The reference is always transformers' own model code (`AutoModelForCausalLM`, fp32 CPU): the
upcycled megamoe model must reproduce the dense HF model's logits, and the exported HF model
the megamoe checkpoint's, within 1e-4.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from hf_models import save_tiny_hf_model  # noqa: E402

from megamoe.checkpointing.hf_source import interleave_qkv, split_qkv, HFArch
from megamoe.errors import MegaMoEError  # noqa: E402
from megamoe.interop.hf_export import check_expressible, export_hf  # noqa: E402
from megamoe.train.config import config_from_dict  # noqa: E402
from megamoe.upcycle import UpcycleRecipe, upcycle_checkpoint  # noqa: E402

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
    ({"score_function": "sigmoid"}, "mixtral", "score_function='sigmoid'"),
    ({"num_groups": 2, "groups_per_token": 1}, "mixtral", "group-limited"),
    ({"router_type": "top_p"}, "qwen3_moe", "router_type='top_p'"),
    ({"pre_softmax": True}, "mixtral", "renormalisation"),
    ({"capacity_factor": 1.0}, "mixtral", "capacity_factor"),
    ({}, "qwen2_moe", "gated shared expert"),
])
def test_export_refuses_what_the_architecture_cannot_express(moe, arch, phrase):
    with pytest.raises(MegaMoEError, match=phrase):
        check_expressible(arch, _config(**moe), [True] * 4)


def test_export_refuses_dense_first_layers_for_mixtral():
    with pytest.raises(MegaMoEError, match="dense layers"):
        check_expressible("mixtral", _config(), [False, True, True, True])


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


def test_cli_bad_input_exit_code_2(tmp_path):
    hf = save_tiny_hf_model("llama", tmp_path / "hf", num_hidden_layers=1)
    _break("missing_shard", hf)
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    for command in (["tools/upcycle_ckpt.py", "--load", str(hf), "--save", str(tmp_path / "o"),
                     "--num-experts", "4", "--topk", "2"],
                    ["tools/export_hf.py", "--load", str(hf), "--save", str(tmp_path / "o")]):
        done = subprocess.run([sys.executable, *command], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert not (tmp_path / "o").exists()
