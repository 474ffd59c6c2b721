"""tools/study_routing.py --quick end to end: two variants through `python -m megamoe.train`,
then the table, JSON, plots and one line per claim."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_study_writes_table_plots_and_claims(tmp_path):
    out = tmp_path / "study"
    done = subprocess.run([sys.executable, "tools/study_routing.py", "--quick", "--out", str(out),
                           "--variants", "aux_loss,bias"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "study.json").read_text())
    assert set(result["variants"]) == {"aux_loss", "bias"}
    for row in result["variants"].values():
        assert row["experts_per_token"] == 2.0 and row["heldout_loss"] > 0
    bar = [c for c in result["claims"] if c["claim"].startswith("bar:")]
    assert len(bar) == 1 and bar[0]["held"] in (True, False)
    assert "| bias |" in (out / "study.md").read_text()
    for name in ("heldout_loss", "maxvio_global", "maxvio_batch", "experts_per_token",
                 "dropped_fraction", "step_time_s"):
        assert (out / f"{name}.png").stat().st_size > 1000
    lines = [l for l in done.stdout.splitlines() if l.startswith(("HELD", "DID NOT HOLD"))]
    assert len(lines) >= 2


def test_unknown_variant_is_one_line_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "tools/study_routing.py", "--variants", "nope",
                           "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "nope" in done.stderr
    assert not (tmp_path / "x").exists()
