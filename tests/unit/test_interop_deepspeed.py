"""Megatron-DeepSpeed MoE checkpoints -> megamoe: the converted MoE layers must compute what
DeepSpeed's own `deepspeed.moe.layer.MoE` computes on the same weights and inputs (<= 1e-5),
and bad input is one line, exit code 2, nothing written. The checkpoints are saved by DeepSpeed
itself (tests/deepspeed_ckpt.py)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

pytest.importorskip("deepspeed")
# Importing DeepSpeed alone costs tens of seconds: the full tier only.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(REPO)}


def _run(*args: str) -> subprocess.CompletedProcess:
    """A Python subprocess with its own free port for DeepSpeed's single-process group (its
    default port is shared by every run on the machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**ENV, "MASTER_PORT": str(port)},
                          capture_output=True, text=True, timeout=300)


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


MODEL_FILE = "mp_rank_00_model_states.pt"
LAYER = "language_model.encoder.layers.{}."
GATE = "mlp.deepspeed_moe.gate.wg.weight"
EXPERT = "language_model.encoder.layers.{}.mlp.deepspeed_moe.experts.deepspeed_experts.{}."


def _edit(path: Path, change) -> None:
    """Load a DeepSpeed file through megamoe's allow-list, let `change` edit the dict (the model
    file's `module`, or an expert file's state), save it back."""
    from megamoe.checkpointing.torch_files import load_torch_file

    state = load_torch_file(path)
    change(state["module"] if "module" in state else state)
    torch.save(state, path)


def _expert_file(tag: Path, moe_id: int, expert: int) -> Path:
    return tag / f"layer_{moe_id}_expert_{expert}_mp_rank_00_model_states.pt"


def _model(key: str, value) -> Callable[[Path], None]:
    """An edit of the model file: `module[key] = value(module)`."""
    return lambda tag: _edit(tag / MODEL_FILE, lambda m: m.update({key: value(m)}))


def _expert(moe_id: int, layer: int, expert: int, **weights) -> Callable[[Path], None]:
    """An edit of one expert file: its `dense_h_to_4h`/`dense_4h_to_h` weights replaced."""
    prefix = EXPERT.format(layer, expert)
    return lambda tag: _edit(_expert_file(tag, moe_id, expert), lambda s: s.update(
        {f"{prefix}{name}.weight": value for name, value in weights.items()}))


EMBEDDING = "language_model.embedding.word_embeddings.weight"
# name -> (edit of the tag folder, what the one-line error must name). Layers 0 and 2 are MoE
# (MoE ids 0 and 1), hidden 16, FFN 32, 4 experts, gelu (tests/deepspeed_ckpt.py).
CRAFTED = {
    "int8 embedding": (_model(EMBEDDING, lambda m: torch.zeros(64, 16, dtype=torch.int8)),
                       "dtype torch.int8"),
    "1-D gate": (_model(LAYER.format(2) + GATE, lambda m: m[LAYER.format(2) + GATE][:, 0].clone()),
                 GATE),
    "a gate of 3 experts when the model has 4": (
        _model(LAYER.format(2) + GATE, lambda m: m[LAYER.format(2) + GATE][:3].clone()),
        "[3, 16]"),
    "(32, 32) expert fc1 in a hidden-16 model": (
        _expert(0, 0, 1, dense_h_to_4h=torch.randn(32, 32)), "[32, 32]"),
    "(32, 32) dense fc1 in a hidden-16 model": (
        _model(LAYER.format(1) + "mlp.dense_h_to_4h.weight", lambda m: torch.randn(32, 32)),
        "[32, 32]"),
    "unequal expert shapes": (
        _expert(1, 2, 3, dense_h_to_4h=torch.randn(24, 16), dense_4h_to_h=torch.randn(16, 24)),
        "layer 2 expert 3"),
    "non-tensor value": (_model(LAYER.format(0) + "input_layernorm.weight", lambda m: [1.0] * 16),
                         "not a tensor"),
    "expanded view of 8 TB": (
        _model(EMBEDDING, lambda m: torch.zeros(1).expand(1 << 21, 1 << 20)), "re-save it"),
    "NaN in an expert": (_expert(1, 2, 0, dense_4h_to_h=torch.full((16, 32), float("nan"))),
                         "NaN"),
    "an expert file beyond the gate's experts": (
        lambda tag: shutil.copy(_expert_file(tag, 0, 3), _expert_file(tag, 0, 4)), "expert 4"),
}

# Runs tools/import_deepspeed_moe.py as a script (run_path, __main__) once per case in one
# interpreter (DeepSpeed's import costs seconds); prints per case its exit code and stderr as JSON.
DRIVER = """
import contextlib, io, json, runpy, sys
results = {}
for load, save in json.loads(sys.argv[1]).items():
    sys.argv = ["import_deepspeed_moe.py", "--load", load, "--save", save, "--topk", "2",
                "--verify"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path("tools/import_deepspeed_moe.py", run_name="__main__")
            code = 0
        except SystemExit as done:
            code = done.code
    results[load] = [code, err.getvalue()]
print(json.dumps(results))
"""


def test_crafted_checkpoints_are_refused_in_one_line(checkpoints, tmp_path):
    """Each tensor is held to the model the checkpoint declares (dtype, shape, experts per
    layer, a tensor of its own): every crafted case, with --verify, is one line naming the
    offender, exit code 2, and no output."""
    import json

    cases = {}
    for number, (name, (craft, fragment)) in enumerate(CRAFTED.items()):
        ds = shutil.copytree(checkpoints[(2, "gelu")], tmp_path / f"case{number}")
        craft(ds / "global_step1")
        cases[str(ds)] = (name, fragment, tmp_path / f"out{number}")
    done = _run("-c", DRIVER, json.dumps({load: str(out) for load, (_, _, out) in cases.items()}))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for load, (name, fragment, out) in cases.items():
        code, stderr = results[load]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, stderr)
        assert fragment in lines[0], (name, lines[0])
        assert not out.exists(), name
