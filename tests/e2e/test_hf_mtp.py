"""Multi-token prediction carried through the Hugging Face round trip: a tiny DeepSeek-V3 (and
GLM-4.5) saved by transformers, with one MTP layer added to its files as the releases store it
(`tests/hf_models.add_mtp_tensors`; transformers neither builds nor saves these tensors), imports
with `model.mtp_layers` set, exports every tensor back bit-identical; the DeepSeek-V3 trains (its
MTP loss logged) and exports again under the same names with the MTP weights moved; `--drop-mtp`
says what it dropped; an MTP copy of the embedding that is not a copy is refused in one line."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")
from hf_models import add_mtp_tensors, save_tiny_hf_model, saved_tensors  # noqa: E402
import warm_launcher

REPO = Path(__file__).resolve().parents[2]
MTP = "model.layers.2."  # the tiny model has 2 decoder layers


def _run(*args: str, code: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline"}
    done = warm_launcher.run([sys.executable, *map(str, args)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=timeout)
    assert done.returncode == code, f"{args[:2]} exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


def _with_mtp(arch: str, folder: Path) -> Path:
    return add_mtp_tensors(save_tiny_hf_model(arch, folder, tokenizer=True))


@pytest.fixture
def hf(tmp_path) -> Path:
    return _with_mtp("deepseek_v3", tmp_path / "hf")


def _round_trip(hf: Path, tmp_path: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """Import `hf`, export it untrained: every tensor, the MTP layer's included, comes back
    bit-identical. Returns the source's tensors and the import's output."""
    source = saved_tensors(hf)
    moe, out = tmp_path / "moe", tmp_path / "out"
    done = _run("tools/import_hf.py", "--load", hf, "--save", moe, "--no-progress")
    assert yaml.safe_load((moe / "train_config.yaml").read_text())["model"]["mtp_layers"] == 1
    _run("tools/export_hf.py", "--load", moe, "--save", out)
    back = saved_tensors(out)
    assert sorted(back) == sorted(source)
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return source, done


def test_glm4_moe_mtp_round_trip_is_bit_identical(tmp_path):
    source, _ = _round_trip(_with_mtp("glm4_moe", tmp_path / "hf"), tmp_path)
    assert sum(name.startswith(MTP) for name in source) == 46


def test_mtp_round_trip_bit_identical_then_trained(hf, corpus_cache, tmp_path):
    source, done = _round_trip(hf, tmp_path)
    assert sum(name.startswith(MTP) for name in source) == 44
    run = tmp_path / "run"
    command = next(line for line in done.stdout.splitlines() if line.startswith("train with: "))
    argv = shlex.split(command.removeprefix("train with: "))
    _run(*argv[1:], f"output_dir={run}", f"data.cache_dir={corpus_cache}",
         "training.train_steps=2", "training.global_batch_size=2", "model.seq_length=32",
         "optimizer.lr=1e-2", "logging.progress_bar=false", "logging.tensorboard=false")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "mtp/depth1/loss" in s] == [1, 2]
    trained = tmp_path / "trained"
    _run("tools/export_hf.py", "--load", run / "checkpoints", "--save", trained)
    after = saved_tensors(trained)
    assert sorted(after) == sorted(source)  # every name written, the MTP layer's included
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.q_a_proj.weight", "mlp.gate.weight"):
        assert not torch.equal(after[MTP + part], source[MTP + part]), part
    assert torch.equal(after[MTP + "embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert torch.equal(after[MTP + "shared_head.head.weight"], after["lm_head.weight"])
    assert not torch.equal(after["lm_head.weight"], source["lm_head.weight"])


def test_drop_mtp_says_what_it_dropped(hf, tmp_path):
    done = _run("tools/import_hf.py", "--load", hf, "--save", tmp_path / "moe", "--no-progress",
                "--drop-mtp")
    assert "multi-token-prediction layer" in done.stdout and MTP in done.stdout
    assert "mtp_layers" not in yaml.safe_load(
        (tmp_path / "moe" / "train_config.yaml").read_text())["model"]


def test_an_mtp_copy_that_differs_is_refused_naming_it(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    shard = hf / "model-mtp.safetensors"
    tensors = load_file(str(shard))
    tensors[MTP + "embed_tokens.weight"][0, 0] += 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    done = _run("tools/import_hf.py", "--load", hf, "--save", tmp_path / "moe", "--no-progress",
                code=2)
    assert MTP + "embed_tokens.weight" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "moe").exists()
