"""tools/study_topp.py: --quick end to end (two variants trained side by side through
`python -m megamoe.train`, the trainer's eval-mode routing metrics read back into the table,
JSON, plots and claims), and its comparison with the top-k line by hand."""
import json
import sys
from pathlib import Path

from tool_modules import tool_module
import warm_launcher

ROOT = Path(__file__).resolve().parents[2]


def test_quick_study_writes_table_plots_and_claims(tmp_path):
    out = tmp_path / "study"
    done = warm_launcher.run([sys.executable, "tools/study_topp.py", "--quick", "--jobs", "2",
                              "--out", str(out), "--variants", "top2,top_p0.4"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "study.json").read_text())
    assert set(result["variants"]) == {"top2", "top_p0.4"}
    top2, top_p = result["variants"]["top2"], result["variants"]["top_p0.4"]
    assert result["base_config"]["model"]["first_k_dense"] == 0
    assert top2["layers"] == [1, 2, 3, 4]  # MoE in the lowest layer too
    assert top2["experts_per_token_by_layer"] == [2.0] * 4  # eval mode, every layer
    assert all(1.0 <= v <= 16.0 for v in top_p["experts_per_token_by_layer"])
    for row in (top2, top_p):
        assert row["heldout_loss"] > 0
        for share in row["tokens_by_experts_by_layer"]:
            assert len(share) == 17 and abs(sum(share) - 1.0) < 1e-6
    assert top2["loss_experts_corr_by_layer"] == [None] * 4  # always 2 experts
    claims = {c["claim"]: c["held"] for c in result["claims"]}
    assert len(claims) == 5 and all(h in (True, False, None) for h in claims.values())
    assert "| top_p0.4 |" in (out / "study.md").read_text()
    for name in ("frontier", "experts_per_token", "loss_by_experts", "heldout_loss"):
        assert (out / f"{name}.png").stat().st_size > 1000
    lines = [l for l in done.stdout.splitlines()
             if l.startswith(("HELD", "DID NOT HOLD", "NOT TESTABLE"))]
    assert len(lines) == 5


def test_top_k_line_interpolates_between_top1_and_top2():
    study = tool_module("study_topp")
    rows = {"top1": {"heldout_loss": 4.0}, "top2": {"heldout_loss": 3.0}}
    assert study.topk_line(rows, 1.25) == 3.75
    assert study.topk_line(rows, 2.5) is None and study.topk_line({}, 1.5) is None
    row = {"heldout_loss": 3.5, "experts_per_token": 1.25}
    ((claim, held, numbers),) = study.claims({**rows, "top_p0.3": row})
    assert held is True and "3.7500" in numbers  # 3.5 below the line's 3.75
