"""Megatron-DeepSpeed MoE checkpoints -> megamoe: the converted MoE layers must compute what
DeepSpeed's own `deepspeed.moe.layer.MoE` computes on the same weights and inputs (<= 1e-5),
and bad input is one line, exit code 2, nothing written. The checkpoints are saved by DeepSpeed
itself (tests/deepspeed_ckpt.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(REPO)}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=300)


def _deepspeed_checkpoint(directory: Path, topk: int, activation: str) -> Path:
    done = _run("tests/deepspeed_ckpt.py", str(directory), str(topk), activation)
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepspeed")
    return {(topk, act): _deepspeed_checkpoint(root / f"{topk}-{act}", topk, act)
            for topk, act in ((2, "gelu"), (1, "swiglu"))}


@pytest.mark.parametrize("topk, activation", [(2, "gelu"), (1, "swiglu")])
def test_converted_layers_match_deepspeed_moe(checkpoints, topk, activation, tmp_path):
    ds = checkpoints[(topk, activation)]
    assert (ds / "global_step1" / "layer_1_expert_3_mp_rank_00_model_states.pt").is_file()
    out = tmp_path / "out"
    done = _run("tools/import_deepspeed_moe.py", "--load", str(ds), "--save", str(out),
                "--topk", str(topk), "--activation", activation, "--verify")
    assert done.returncode == 0, done.stderr[-3000:]
    diff = float(done.stdout.split("megamoe vs DeepSpeed MoE:")[1].split()[0])
    assert diff <= 1e-5
    assert (out / "release" / "metadata.json").is_file()


def test_missing_expert_file_is_one_line_exit_2(checkpoints, tmp_path):
    ds = shutil.copytree(checkpoints[(2, "gelu")], tmp_path / "ds")
    (ds / "global_step1" / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    done = _run("tools/import_deepspeed_moe.py", "--load", str(ds), "--save",
                str(tmp_path / "out"), "--topk", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "missing for experts [2]" in done.stderr
    assert not (tmp_path / "out").exists()
