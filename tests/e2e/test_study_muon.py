"""tools/study_muon.py --quick end to end (AdamW and Muon grids through `python -m
megamoe.train`, then the table, JSON, curves and claim lines) and its step-ratio arithmetic."""
import csv
import json
import math
import sys
from pathlib import Path

from tool_modules import tool_module
import warm_launcher

ROOT = Path(__file__).resolve().parents[2]


def test_quick_study_writes_table_json_and_curves(tmp_path):
    out = tmp_path / "study"
    done = warm_launcher.run([sys.executable, "tools/study_muon.py", "--quick", "--jobs", "2",
                              "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "study.json").read_text())
    grids = {name: result["best"][name]["grid"] for name in ("adamw", "muon")}
    assert all(len(grid) == 3 for grid in grids.values())
    # Every grid run plus AdamW's longer run at its best rate, all finished and finite.
    assert len(result["runs"]) == 3 + 3 + 1
    for name, run in result["runs"].items():
        assert run["optimizer"] in grids and run["lr"] in grids["adamw" if "adamw" in name
                                                                 else "muon"]
        assert run["last_step"] == (2 * result["steps"] if "_long_" in name else result["steps"])
        assert all(math.isfinite(loss) and loss > 0 for _, loss in run["curve"])
    for name in grids:
        best = result["best"][name]
        assert best["best_lr"] in grids[name] and isinstance(best["interior"], bool)
        assert best["mean_heldout_loss"][grids[name].index(best["best_lr"])] == min(
            best["mean_heldout_loss"])
    (seed,) = result["at_equal_steps"]
    assert isinstance(seed["muon_below_adamw"], bool)
    assert seed["step_ratio"] is None or seed["step_ratio"] > 0
    grid_run = result["runs"][f"adamw_lr{result['best']['adamw']['best_lr']:g}_seed{seed['seed']}"]
    assert (seed["adamw"], seed["muon"]) == (grid_run["heldout_loss"], result["runs"][
        f"muon_lr{result['best']['muon']['best_lr']:g}_seed{seed['seed']}"]["heldout_loss"])
    assert math.isfinite(seed["adamw_long_at_steps"])
    rows = list(csv.DictReader((out / "curves.csv").open()))
    assert {r["run"] for r in rows} == set(result["runs"])
    assert all(math.isfinite(float(r["heldout_loss"])) for r in rows)
    table = (out / "study.md").read_text()
    assert "| muon |" in table and "| adamw |" in table
    assert (out / "heldout_loss.png").stat().st_size > 1000
    assert any(line.startswith(("HELD", "DID NOT HOLD")) for line in done.stdout.splitlines())


def test_steps_to_reach_interpolates_between_evaluations():
    study = tool_module("study_muon")
    curve = [[25, 5.0], [50, 4.0], [75, 3.5]]
    assert study.steps_to_reach(curve, 3.75) == 62.5  # halfway from 4.0 (step 50) to 3.5 (75)
    assert study.steps_to_reach(curve, 6.0) == 25.0
    assert study.steps_to_reach(curve, 3.0) is None


def test_a_grid_of_two_rates_is_one_line_exit_2(tmp_path):
    done = warm_launcher.run([sys.executable, "tools/study_muon.py", "--muon-lrs", "1e-3,2e-3",
                              "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "1e-3,2e-3" in done.stderr
    assert not (tmp_path / "x").exists()
