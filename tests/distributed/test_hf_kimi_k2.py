"""Kimi-K2 in and out: a DeepSeek-V3 built by transformers with Kimi-K2's structural settings
(tests/hf_models.py KIMI_K2: 384 experts, 8 chosen, one group, routed scaling 2.827, one dense
layer, YaRN x32) imports with --verify (tools/import_hf.py's import_hf), gives transformers'
logits at expert-parallel size 2, trains 2 steps there and exports (export_hf with --verify)
what transformers reproduces; untrained, it comes back bit-identical with its config.json, also
as Moonshot ships it (`model_type: kimi_k2`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import hf_import_workers  # noqa: E402
from hf_models import (KIMI_K2, VOCAB, save_tiny_hf_model, saved_config,  # noqa: E402
                       saved_tensors)
from megamoe.parallel.spawn import spawn_ranks as spawn  # noqa: E402

BAR = 1e-4
TRAIN_STEPS = 2


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> tuple[Path, Path, float]:
    """(HF dir, import dir, the import's --verify figure)."""
    from megamoe.interop.hf_import import import_hf

    root = tmp_path_factory.mktemp("kimi_k2")
    hf = save_tiny_hf_model("deepseek_v3", root / "hf", tokenizer=True, **KIMI_K2)
    diff = import_hf(hf, root / "imported", verify=True, progress=False, log=lambda line: None)
    return hf, root / "imported", diff


def test_kimi_k2_settings_import_as_its_routing(kimi):
    """One group of 384 experts, 8 chosen by sigmoid scores plus the correction bias, gates
    renormalised and scaled by 2.827: transformers' logits at EP=1 (the import's --verify)."""
    import yaml

    hf, folder, diff = kimi
    assert diff <= BAR
    moe = yaml.safe_load((folder / "train_config.yaml").read_text())["moe"]
    assert (moe["num_experts"], moe["topk"]) == (384, 8)
    assert moe["router"]["topk_scaling_factor"] == 2.827
    assert moe["router"].get("num_groups") in (None, 1)


def test_kimi_k2_trains_at_ep2_and_exports_what_transformers_reproduces(kimi, corpus_cache,
                                                                        tmp_path):
    import torch
    import yaml

    from megamoe.interop.hf_export import export_hf
    from megamoe.upcycle.hf_logits import hf_logits, load_hf_model, sample_tokens

    hf, folder, _ = kimi
    tokens = sample_tokens(VOCAB)
    sections = yaml.safe_load((folder / "train_config.yaml").read_text())
    training = {"output_dir": str(tmp_path / "runs"), "data": {"cache_dir": str(corpus_cache)},
                "training": {"train_steps": TRAIN_STEPS, "micro_batch_size": 2,
                             "global_batch_size": 4},
                "optimizer": {"lr": 1e-2},
                "logging": {"progress_bar": False, "tensorboard": False}}
    results = spawn(2, hf_import_workers.import_job, str(tmp_path), 1000,
                    imports={"kimi_k2": (str(folder), sections)}, tokens=tokens,
                    training=training)
    reference = hf_logits(load_hf_model(hf), tokens)
    for rank in (0, 1):
        diff = float((results[rank]["kimi_k2"][..., :VOCAB] - reference).abs().max())
        assert diff <= BAR, f"rank {rank}: {diff:.3e}"
    back = tmp_path / "back"
    result = export_hf(tmp_path / "runs" / "kimi_k2" / "checkpoints", back, arch="deepseek_v3",
                       verify=True, log=lambda line: None)
    assert result.max_logit_diff <= BAR
    assert saved_config(back) == saved_config(hf)
    moved = hf_logits(load_hf_model(back), tokens) - reference
    assert float(moved.abs().max()) > 1e-3
    assert torch.isfinite(moved).all()


def test_kimi_k2_round_trip_is_bit_identical(kimi, tmp_path):
    """Untrained, exported back: bit-identical tensors and the same config.json; and the same
    for the files as Moonshot ships them, config.json `model_type: kimi_k2` (which transformers
    has no class for: --verify runs its `architectures`' DeepseekV3ForCausalLM)."""
    import shutil

    import torch

    from megamoe.interop.hf_export import export_hf
    from megamoe.interop.hf_import import import_hf

    hf, folder, _ = kimi
    released = tmp_path / "released"
    shutil.copytree(hf, released)
    config = json.loads((released / "config.json").read_text())
    (released / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    assert import_hf(released, tmp_path / "imported", verify=True, progress=False,
                     log=lambda line: None) <= BAR
    for source, imported in ((hf, folder), (released, tmp_path / "imported")):
        back = tmp_path / f"back_{source.name}"
        export_hf(imported, back, verify=True, log=lambda line: None)
        original, exported = saved_tensors(source), saved_tensors(back)
        assert sorted(original) == sorted(exported)
        assert not [name for name in original if not torch.equal(original[name],
                                                                 exported[name])]
        assert saved_config(back) == saved_config(source)
