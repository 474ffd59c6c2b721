"""Checkpoints across megatron-core versions and checkpoint formats: the committed fixtures
(`tests/fixtures/mcore_checkpoints/`, made by `make_mcore_checkpoints.py` under megatron-core
0.16.1 and 0.19.2, in checkpoint format 1: flat MoE settings, from the flat config.yaml beside
them) resume and serve as `checkpoint.init_from` under the installed version and format 2, and
give the losses that the version which wrote them logged (same synthetic data, same seed), but
for step 6: the megamoe that wrote them decayed norm weights (step 5's update), which Megatron's
parameter groups exclude; expected.json holds step 6 as megamoe trains it now.

A 0.16 checkpoint keeps its common state in `common.pt`; a 0.19 one keeps it inside the
`.distcp` files. Both are read on both versions, through the same allow-listed loaders."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import warm_launcher

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mcore_checkpoints"
VERSIONS = sorted(p.name for p in FIXTURES.glob("mcore-*"))
DATA = FIXTURES / "data" / "synthetic"


def train(out: Path, *overrides: str) -> dict[int, float]:
    """Run the trainer on the fixtures' config; the loss of each step it logged."""
    done = warm_launcher.run(
        [sys.executable, "-m", "megamoe.train", "--config", str(FIXTURES / "config.yaml"),
         f"output_dir={out}", f"data.prefixes=[{DATA}]", f"data.tokenizer_model={DATA}.model",
         f"data.cache_dir={out / 'cache'}", *overrides],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}


def expected(version: str) -> dict:
    return json.loads((FIXTURES / version / "expected.json").read_text())


def test_there_is_a_fixture_of_every_supported_version():
    from megamoe.megatron.compat import SUPPORTED

    assert {tuple(map(int, v.removeprefix("mcore-").split(".")[:2])) for v in VERSIONS} == \
        set(SUPPORTED)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_checkpoint_of_each_version_resumes_with_its_own_losses(tmp_path, version):
    want = expected(version)
    shutil.copytree(FIXTURES / version / "checkpoints", tmp_path / "checkpoints")
    last = max(map(int, want["resumed_losses"]))
    got = train(tmp_path, f"training.train_steps={last}")
    assert sorted(got) == sorted(map(int, want["resumed_losses"]))  # continued at the position
    for step, loss in want["resumed_losses"].items():
        assert got[int(step)] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    from megamoe.checkpointing.safe_dcp import load_common_state

    saved = load_common_state(tmp_path / "checkpoints" / f"iter_{last:07d}")
    assert saved["format_version"] == 2  # what it saves next holds the settings tree
    assert saved["config"]["moe"]["balancing"]["methods"] in ("bias", ["bias"])
    assert saved["config"]["moe"]["router"]["score_function"] == "sigmoid"


@pytest.mark.parametrize("version", VERSIONS)
def test_a_checkpoint_of_each_version_serves_as_init_from(tmp_path, version):
    want = expected(version)
    got = train(tmp_path, "training.train_steps=1",
                f"checkpoint.init_from={FIXTURES / version / 'checkpoints'}")
    assert got[1] == pytest.approx(want["init_from_losses"]["1"], rel=1e-5, abs=1e-6)
