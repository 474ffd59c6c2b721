"""tools/study_simoe.py --quick: the whole SIMoE study pipeline (dense pretraining, full / LoRA /
sparse-upcycled / SIMoE instruction tuning through `python -m megamoe.train`, exact-match
evaluation, mask inspection, table and plots) on a few steps; parameter counts against the
architecture's own arithmetic."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tool_modules import tool_module
import warm_launcher

REPO = Path(__file__).resolve().parents[2]


def quick_study(out: Path, runs: Path, corpus_cache) -> subprocess.CompletedProcess:
    return warm_launcher.run([sys.executable, "tools/study_simoe.py", "--quick", "--jobs", "2",
                              "--out", str(out), "--runs", str(runs), "--cache-dir",
                              str(corpus_cache)], cwd=REPO, capture_output=True, text=True,
                             timeout=900)


def test_quick_study_runs_every_method_and_counts_parameters(corpus_cache, tmp_path):
    out = tmp_path / "study"
    done = quick_study(out, tmp_path / "runs", corpus_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "study.json").read_text())
    assert {p.name for p in out.iterdir()} >= {"study.md", "study.json", "mask_density.png",
                                               "mask_overlap.png", "router_coefficients.png"}
    rows = result["rows"]
    assert set(rows) == {"full", "lora", "sparse_upcycling", "simoe"}
    # configs/simoe_instruct.yaml: 4 layers, hidden 128, FFN 384 (SwiGLU), 8 SIMoE experts.
    h, f, layers, m = 128, 384, 4, 8
    linears = [(3 * h, h), (h, h), (2 * f, h), (h, f)]  # qkv, proj, fc1, fc2 as [out, in]
    delta = layers * (sum(o * i for o, i in linears) + 2 * h) + h
    masks = m * (layers * (sum(i for _, i in linears) + 2 * h) + h)
    assert result["delta_parameters"] == delta
    assert rows["simoe"]["trainable"] == delta + masks + m * h  # + the router
    rank = result["lora_rank"]
    assert rank == round(delta / (layers * sum(o + i for o, i in linears)))
    assert rows["lora"]["trainable"] == rank * layers * sum(o + i for o, i in linears)
    assert rows["full"]["trainable"] == rows["full"]["stored"] == rows["simoe"]["active"]
    experts = layers * 4 * 3 * h * f
    assert rows["sparse_upcycling"]["active"] == rows["sparse_upcycling"]["stored"] - experts // 2
    assert len(result["claims"]) == 6 and result["seeds"] == 1
    for row in rows.values():  # the quick grid has one rate, chosen on the validation split
        assert row["lr"] == 1e-3 and set(row["validation"]) == {"0.001"}
        assert 0.0 <= row["validation"]["0.001"] <= 1.0
        assert not any(family.startswith("valid") for family in row["per_family"])
    assert result["mask_lr"] == pytest.approx(0.05) and result["jobs"] == 2
    assert "examples per seed" in result["claims"][0]["evidence"]
    assert all(line in done.stdout for line in
               (("HELD: " if c["held"] else "NOT HELD: ") + c["claim"] for c in result["claims"]))
    # The dense seed pretrained on the default corpus and the families' facts, half and half.
    seed = yaml.safe_load((tmp_path / "runs" / "seed0" / "seed" / "config.yaml").read_text())
    default, facts = seed["data"]["prefixes"]
    assert Path(default).parent.parent == corpus_cache and seed["data"]["weights"] == [0.5, 0.5]
    assert Path(facts + ".idx").is_file() and Path(facts).name == "knowledge"
    # A rerun in the same --runs folder trains nothing (knowledge corpus, dense seed, upcycling
    # and 4 tunings reused) and reports the same study.
    again = quick_study(tmp_path / "again", tmp_path / "runs", corpus_cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("reusing the finished run") == 7 and "] done in" not in again.stdout
    assert json.loads((tmp_path / "again" / "study.json").read_text()) == result


def test_runs_folder_that_is_not_a_study_is_refused_untouched(tmp_path):
    mine = tmp_path / "runs" / "seed0" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    done = warm_launcher.run([sys.executable, "tools/study_simoe.py", "--quick", "--runs",
                              str(tmp_path / "runs"), "--out", str(tmp_path / "x")], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "seed0" in done.stderr and mine.read_text() == "mine"
    assert not (tmp_path / "x").exists() and sorted(tmp_path.rglob("*")) == [
        tmp_path / "runs", mine.parent, mine]


def test_simoe_masks_keep_their_own_rate_at_every_rate_of_the_grid():
    from megamoe.train.config import load_config

    study = tool_module("study_simoe")
    for lr in (1e-3, 3e-3, 1e-2):
        config = load_config(study.INSTRUCT_CONFIG, study.rate_overrides("simoe", lr))
        assert (config.optimizer.lr, config.optimizer.min_lr) == (lr, pytest.approx(lr / 10))
        # SIMoEConfig's mask_lr_scale 50 at configs/simoe_instruct.yaml's rate 1e-3
        assert config.finetune.simoe["mask_lr_scale"] * lr == pytest.approx(0.05)
    assert not any("simoe" in override for override in study.rate_overrides("full", 3e-3))


def test_best_rate_is_the_best_on_validation_and_the_smaller_on_a_tie():
    study = tool_module("study_simoe")
    assert study.best_rate({1e-3: 0.2, 3e-3: 0.5, 1e-2: 0.1}) == 3e-3
    assert study.best_rate({3e-3: 0.4, 1e-3: 0.4}) == 1e-3


def test_standard_error_is_the_binomial_one_of_the_mean_over_seeds():
    study = tool_module("study_simoe")
    assert study.standard_error([0.5], 100) == pytest.approx(0.05)  # sqrt(0.25 / 100)
    # two seeds: sqrt(0.1 * 0.9 / 100 + 0.3 * 0.7 / 100) / 2
    assert study.standard_error([0.1, 0.3], 100) == pytest.approx(0.0273861, rel=1e-5)
    assert study.standard_error([0.0, 1.0], 40) == 0.0


@pytest.mark.parametrize("flag", [["--learning-rates", "1e-3,x"], ["--learning-rates", "0"],
                                  ["--jobs", "0"]])
def test_bad_flags_are_one_line_exit_2(tmp_path, flag):
    done = warm_launcher.run([sys.executable, "tools/study_simoe.py", *flag,
                              "--out", str(tmp_path / "x")], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert flag[1] in done.stderr and not (tmp_path / "x").exists()
