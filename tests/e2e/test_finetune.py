"""Instruction tuning through `python -m megamoe.train` (finetune.method): SIMoE from a dense
checkpoint resumes exactly (masks, deltas, router and the Lagrange multipliers are in the
checkpoint), and bad instruction data stops the run before it writes anything."""
import json
import os
import sys
from pathlib import Path

import pytest

from megamoe.instruct import tasks
from test_train import records, train
import warm_launcher

REPO = Path(__file__).resolve().parents[2]
SEED = REPO / "configs" / "simoe_dense_seed.yaml"
INSTRUCT = REPO / "configs" / "simoe_instruct.yaml"
STEPS = 6


@pytest.fixture(scope="module")
def seed_and_data(corpus_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    train(corpus_cache, root / "seed", "training.train_steps=2", nproc=1, config=SEED)
    data = tasks.write_instruction_set(root / "data", per_family_train=8, per_family_eval=1)
    tune = [f"checkpoint.init_from={root / 'seed' / 'checkpoints'}",
            f"finetune.train_data={data['train']}", f"finetune.eval_data=[{data['eval_unseen']}]",
            f"training.train_steps={STEPS}", "optimizer.warmup_steps=2", "checkpoint.interval=0",
            "training.micro_batch_size=4", "training.global_batch_size=8"]
    return tune, root


def test_simoe_tuning_resumes_exactly(corpus_cache, seed_and_data, tmp_path):
    tune, _ = seed_and_data
    train(corpus_cache, tmp_path / "straight", *tune, nproc=1, config=INSTRUCT)
    train(corpus_cache, tmp_path / "split", *tune, f"training.exit_interval={STEPS // 2}",
          nproc=1, config=INSTRUCT)
    train(corpus_cache, tmp_path / "split", *tune, nproc=1, config=INSTRUCT)
    straight, split = records(tmp_path / "straight"), records(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, STEPS + 1))
    for a, b in zip(straight, split):
        for key in ("loss", "grad_norm", "simoe/density", "simoe/multiplier"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (a["step"], key)
    assert straight[-1]["simoe/multiplier"] > 0  # the Lagrangian acted, and was restored
    assert "eval/eval_unseen/all" in straight[-1]


def test_bad_instruction_data_is_one_line_exit_2_and_writes_nothing(corpus_cache, seed_and_data,
                                                                     tmp_path):
    tune, _ = seed_and_data
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Add 1 and 2.", "response": " 3"}) + "\n{oops\n")
    out = tmp_path / "run"
    done = warm_launcher.run(
        [sys.executable, "-m", "megamoe.train", "--config", str(INSTRUCT), f"output_dir={out}",
         f"data.cache_dir={corpus_cache}", *tune, f"finetune.train_data={bad}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert done.returncode == 2
    assert f"{bad}:2: not valid JSON" in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("error:")]) == 1
    assert not out.exists()
