"""The two-way architecture tables (megamoe.checkpointing.hf, issue 48): one table per
architecture drives both the import and the export, and every conversion accounts for every
tensor. References: transformers' own logits (`--verify`), the source files bit for bit, and a
by-hand permutation for DeepSeek's RoPE rows."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from hf_models import save_tiny_hf_model, saved_tensors  # noqa: E402

from megamoe.checkpointing.hf import ARCHITECTURES  # noqa: E402
from megamoe.checkpointing.hf.base import TensorLedger  # noqa: E402
from megamoe.checkpointing.hf.deepseek_v3 import RopeInterleave  # noqa: E402
from megamoe.errors import CheckpointError, MegaMoEError  # noqa: E402
from tool_modules import tool_module  # noqa: E402

QUIET = dict(log=lambda line: None)


def test_the_tools_offer_every_registered_architecture():
    """`--arch` choices and the import's refusal come from the registry, not a list of their
    own."""
    parser = tool_module("export_hf").build_parser()
    arch = next(a for a in parser._actions if a.dest == "arch")
    assert list(arch.choices) == list(ARCHITECTURES)
    from megamoe.checkpointing.hf import architecture

    with pytest.raises(CheckpointError) as err:
        architecture({"model_type": "olmoe"}, Path("config.json"))
    assert all(name in str(err.value) for name in ARCHITECTURES)


def test_rope_rows_permute_into_deepseek_pairs_and_back():
    """Rotate-half rows [x0 x1 x2 | y0 y1 y2] of each head's RoPE part become DeepSeek's pairs
    [x0 y0 x1 y1 x2 y2], the non-RoPE rows untouched; the inverse restores the source."""
    nope, rope, heads = 2, 6, 2
    rows = torch.arange(heads * (nope + rope), dtype=torch.float32)[:, None].repeat(1, 3)
    moved = RopeInterleave(nope + rope, nope).to_megatron([rows])
    for h in range(heads):
        base = h * (nope + rope)
        want = [base, base + 1] + [base + nope + i for i in (0, 3, 1, 4, 2, 5)]
        assert moved[base:base + nope + rope, 0].tolist() == want
    assert torch.equal(RopeInterleave(nope + rope, nope).to_hf(moved, [rows.shape])[0], rows)


def test_deepseek_without_rope_interleave_imports_and_exports_bit_identical(tmp_path):
    """A DeepSeek-V3 saved in rotate-half order (rope_interleave false): the import reproduces
    transformers' logits, and the export (the same table run backwards) gives the files back."""
    from megamoe.interop.hf_export import export_hf
    from megamoe.interop.hf_import import import_hf

    hf = save_tiny_hf_model("deepseek_v3", tmp_path / "hf", rope_interleave=False)
    assert import_hf(hf, tmp_path / "in", verify=True, progress=False, **QUIET) <= 1e-4
    export_hf(tmp_path / "in", tmp_path / "back", **QUIET)
    original, back = saved_tensors(hf), saved_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    assert all(torch.equal(original[name], back[name]) for name in original)


def test_the_ledger_names_what_was_left_over():
    ledger = TensorLedger({"a": (2,), "b": (3,), "mtp": (1,)}, "ckpt", "the model")
    ledger.mark("a", (2,))
    ledger.skip(["mtp"])
    with pytest.raises(CheckpointError, match="tensor b of the model was not converted"):
        ledger.close()
    with pytest.raises(CheckpointError, match=r"tensor a has shape \[4\]"):
        ledger.mark("a", (4,))
    with pytest.raises(CheckpointError, match="tensor c is not among the 3 tensors"):
        ledger.mark("c")
    ledger.mark("b", (3,))
    assert ledger.close() == "2 of 3 tensors of the model (1 dropped)"


def test_a_table_that_forgets_a_tensor_fails_naming_it(monkeypatch, tmp_path):
    """Qwen3-MoE's table with the rule of the per-head K norm forgotten (how converters drift):
    the import names the file tensor no rule reads, the export the checkpoint tensor no rule
    writes, in one line, and nothing is written."""
    from megamoe.interop.hf_export import export_hf
    from megamoe.interop.hf_import import import_hf

    hf = save_tiny_hf_model("qwen3_moe", tmp_path / "hf", num_hidden_layers=1)
    import_hf(hf, tmp_path / "in", progress=False, **QUIET)
    table = type(ARCHITECTURES["qwen3_moe"])
    rules = table.layer_rules
    monkeypatch.setattr(table, "layer_rules", lambda self, model, index: [
        rule for rule in rules(self, model, index)
        if rule.megatron != "self_attention.k_layernorm.weight"])
    with pytest.raises(MegaMoEError, match=r"model.layers.0.self_attn.k_norm.weight") as err:
        import_hf(hf, tmp_path / "again", progress=False, **QUIET)
    assert "\n" not in str(err.value)
    with pytest.raises(MegaMoEError, match=r"tensor self_attention.k_layernorm.weight has no "
                                           r"place") as err:
        export_hf(tmp_path / "in", tmp_path / "back", **QUIET)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "in"]


def test_every_rule_inverts_exactly():
    """For each architecture's tiny model, each rule's inverse transform gives back the
    Hugging Face tensors it was made from (random values), in the shapes the table states."""
    from transformers import AutoConfig

    from hf_models import ARCHS, BASE

    torch.manual_seed(0)
    for name, arch in ARCHS.items():
        if name not in ARCHITECTURES:
            continue
        config = AutoConfig.for_model(name, **{**BASE, **arch}).to_dict()
        table = ARCHITECTURES[name]
        model = table.read_config(config, Path("config.json"))
        for block in table.blocks(model):
            for rule in block.rules:
                if not rule.hf:
                    continue
                parts = [torch.randn(shape) for shape in rule.shapes]
                back = rule.transform.to_hf(rule.transform.to_megatron(parts), rule.shapes)
                assert len(back) == len(parts), (name, rule.megatron)
                assert all(torch.equal(a, b) for a, b in zip(parts, back)), (name, rule.megatron)


@pytest.mark.parametrize("model, moe, phrase", [
    ({"sliding_window": 128}, {}, r"sliding-window attention \(model.sliding_window\); use "
                                  r"gpt_oss"),
    ({"yarn": {"factor": 4.0, "original_max_position_embeddings": 256}}, {},
     r"YaRN rope scaling \(model.yarn\); use deepseek_v3 or .*gpt_oss"),
    ({}, {"experts": {"bias": True}}, r"expert biases \(moe.experts.bias\); use gpt_oss"),
    ({"mtp_layers": 1}, {}, r"multi-token prediction \(model.mtp_layers\); use deepseek_v3"),
])
def test_a_feature_the_architecture_lacks_is_refused_naming_who_has_it(model, moe, phrase):
    """Settings an architecture's config.json has no field for (so an export would drop them
    silently) are refused, naming the architectures that hold them (`Architecture.features`)."""
    from megamoe.interop.hf_export import check_expressible
    from megamoe.train.config import config_from_dict

    config = config_from_dict({"model": {"position_embedding": "rope", **model},
                               "moe": {"num_experts": 4, "ffn_hidden_size": 32, "topk": 2,
                                       **moe}})
    with pytest.raises(MegaMoEError, match=r"--arch mixtral cannot express " + phrase) as err:
        check_expressible("mixtral", config, [True] * config.model.num_layers)
    assert "\n" not in str(err.value)


def test_a_bf16_release_comes_back_with_each_tensor_as_saved(tmp_path):
    """transformers saves a bf16 DeepSeek-V3's router and correction bias in fp32: the import
    keeps each tensor in its saved dtype (no --dtype), so the export gives every tensor back
    bit for bit, dtype included."""
    from transformers import AutoModelForCausalLM

    from megamoe.interop.hf_export import export_hf
    from megamoe.interop.hf_import import import_hf

    fp32 = save_tiny_hf_model("deepseek_v3", tmp_path / "fp32", num_hidden_layers=2)
    AutoModelForCausalLM.from_pretrained(str(fp32), dtype=torch.bfloat16).save_pretrained(
        str(tmp_path / "hf"))
    original = saved_tensors(tmp_path / "hf")
    assert {t.dtype for t in original.values()} == {torch.bfloat16, torch.float32}
    import_hf(tmp_path / "hf", tmp_path / "in", progress=False, **QUIET)
    export_hf(tmp_path / "in", tmp_path / "back", **QUIET)
    back = saved_tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    changed = [n for n in original if back[n].dtype != original[n].dtype
               or not torch.equal(back[n], original[n])]
    assert not changed, changed[:3]


def test_qwen2_moe_export_of_a_model_without_qkv_biases_writes_zero_biases(tmp_path):
    """Qwen2-MoE always has QKV biases: a Llama upcycled with a gated shared expert (no biases)
    exports them as zeros (`zeros_if_absent`), and transformers reproduces megamoe's logits."""
    from megamoe.interop.hf_export import export_hf
    from megamoe.upcycle import UpcycleRecipe, upcycle_checkpoint

    hf = save_tiny_hf_model("llama", tmp_path / "hf", num_hidden_layers=1)
    recipe = UpcycleRecipe(num_experts=4, topk=2, shared_expert=True, shared_expert_gate=True)
    upcycle_checkpoint(hf, tmp_path / "moe", recipe, verify=False, progress=False, **QUIET)
    result = export_hf(tmp_path / "moe", tmp_path / "out", arch="qwen2_moe", verify=True,
                       **QUIET)
    assert result.max_logit_diff <= 1e-4
    biases = {n: t for n, t in saved_tensors(tmp_path / "out").items() if n.endswith("_proj.bias")}
    assert sorted(biases) == [f"model.layers.0.self_attn.{p}_proj.bias" for p in "kqv"]
    assert all(not t.any() for t in biases.values())
