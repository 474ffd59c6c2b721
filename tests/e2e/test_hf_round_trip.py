"""The whole Hugging Face round trip on tiny random models of each architecture: HF dense ->
megamoe MoE (tools/upcycle_ckpt.py) -> a few training steps (`python -m megamoe.train` with the
upcycler's train_config.yaml) -> Hugging Face MoE (tools/export_hf.py) -> transformers' logits
equal the trained megamoe checkpoint's (and differ from the dense model's: training moved the
weights)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from hf_models import save_tiny_hf_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BAR = 1e-4
# Dense architecture -> (upcycler flags, export architecture). Mistral's and Qwen3's upcycling
# is checked against transformers in tests/unit/test_interop_hf.py, and a Qwen3-MoE trained and
# exported in tests/distributed/test_hf_import.py: the whole trip runs for two (CI time).
ROUTES = {
    "llama": ([], "mixtral"),
    "qwen2": (["--shared-expert", "--shared-expert-gate", "--moe-layers", "1"], "qwen2_moe"),
}


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:2]} exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.parametrize("arch", sorted(ROUTES))
def test_hf_dense_to_trained_moe_to_hf(arch, corpus_cache, tmp_path):
    from megamoe.upcycle.hf_logits import hf_logits, load_hf_model, sample_tokens

    flags, target = ROUTES[arch]
    hf = save_tiny_hf_model(arch, tmp_path / "hf")
    moe = tmp_path / "moe"
    _run("tools/upcycle_ckpt.py", "--load", str(hf), "--save", str(moe), "--num-experts", "4",
         "--topk", "2", "--no-progress", *flags)
    run = tmp_path / "run"
    _run("-m", "megamoe.train", "--config", str(moe / "train_config.yaml"), f"output_dir={run}",
         f"data.cache_dir={corpus_cache}", "training.train_steps=3", "model.seq_length=32",
         "training.micro_batch_size=2", "training.global_batch_size=2", "optimizer.lr=1e-2",
         f"checkpoint.init_from={moe}", "logging.progress_bar=false",
         "logging.tensorboard=false")
    out = tmp_path / "exported"
    done = _run("tools/export_hf.py", "--load", str(run / "checkpoints"), "--save", str(out),
                "--arch", target, "--verify")
    diff = float(done.stdout.split("max |logit diff| megamoe vs transformers:")[1].split()[0])
    assert diff <= BAR
    tokens = sample_tokens(4096)
    moved = (hf_logits(load_hf_model(out), tokens) - hf_logits(load_hf_model(hf), tokens))
    assert float(moved.abs().max()) > 1e-3
