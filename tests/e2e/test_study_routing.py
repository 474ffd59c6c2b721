"""tools/study_routing.py --quick end to end: two variants through `python -m megamoe.train`,
then the table, JSON, plots and one line per claim."""
import json
import sys
from pathlib import Path

import pytest

from tool_modules import tool_module
import warm_launcher

ROOT = Path(__file__).resolve().parents[2]


def test_quick_study_writes_table_plots_and_claims(tmp_path):
    out = tmp_path / "study"
    done = warm_launcher.run([sys.executable, "tools/study_routing.py", "--quick", "--out",
                              str(out), "--variants", "aux_loss,bias"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "study.json").read_text())
    assert set(result["variants"]) == {"aux_loss", "bias"}
    for row in result["variants"].values():
        assert row["experts_per_token"] == 2.0 and row["heldout_loss"] > 0
        assert 0 <= row["maxvio_pooled"] <= 3 and len(row["maxvio_pooled_by_layer"]) == 3
    assert result["sampling_floor"].startswith("Sampling floor: 512 independent tokens")
    bar = [c for c in result["claims"] if c["claim"].startswith("bar:")]
    assert len(bar) == 1 and bar[0]["held"] in (True, False)
    assert "| bias |" in (out / "study.md").read_text()
    for name in ("heldout_loss", "maxvio_global", "maxvio_batch", "experts_per_token",
                 "dropped_fraction", "step_time_s"):
        assert (out / f"{name}.png").stat().st_size > 1000
    lines = [l for l in done.stdout.splitlines() if l.startswith(("HELD", "DID NOT HOLD"))]
    assert len(lines) >= 2


def test_pooled_maxvio_sums_the_counts_of_the_last_steps():
    study = tool_module("study_routing")
    # Three steps of 100 tokens over 4 experts (2, 2 and 1 experts per token); the first falls
    # outside a 2-step window.
    steps = [[90, 50, 40, 20], [10, 60, 70, 60], [35, 15, 25, 25]]
    records = [{"step": s + 1, "moe/layer2/load": [c / sum(counts) for c in counts],
                "moe/layer2/experts_per_token": sum(counts) / 100}
               for s, counts in enumerate(steps)]
    study.TAIL, saved = 2, study.TAIL
    try:
        pooled = study.pooled_maxvio(records, 2)
    finally:
        study.TAIL = saved
    counts = [a + b for a, b in zip(steps[1], steps[2])]  # 45 75 95 85, mean 75
    assert abs(pooled - (95 - 75) / 75) < 1e-12 and max(counts) == 95


def test_iid_floor_shrinks_with_the_square_root_of_the_tokens():
    study = tool_module("study_routing")
    small, large = study.iid_maxvio(1024, 8, 2), study.iid_maxvio(16 * 1024, 8, 2)
    assert 3.0 < small / large < 5.5  # sqrt(16) = 4, up to sampling noise


@pytest.mark.parametrize("tool", ["study_routing", "study_topp"])
def test_every_variant_is_the_setup_it_names(tool, tmp_path, capsys):
    """Each variant's overrides, with and without --quick's, load as a training config without
    a flat-key note, and build the router, experts per token, balancing and capacity its setup
    line names (--quick shortens the threshold router's warm-up only)."""
    import yaml

    from megamoe.train.config import load_config

    study, routing = tool_module(tool), tool_module("study_routing")
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(study.BASE_CONFIG))
    for name, (setup, overrides) in study.VARIANTS.items():
        for quick in (False, True):
            moe = load_config(str(base), [*overrides, *(
                routing.quick_overrides(overrides) if quick else [])]).moe_config()
            kind = moe.router.kind
            assert {"top_p": "top-p", "threshold": "threshold", "sinkhorn": "Sinkhorn",
                    "base": "BASE", "topk": f"top-{moe.topk}"}[kind] in setup, name
            assert (moe.balancing.methods == "none") == ("no aux loss" in setup), name
            assert (moe.dispatcher.capacity_factor == 1.0) == ("capacity" in setup), name
            assert (moe.shared_expert.ffn_hidden_size is not None) == ("shared" in setup), name
            if kind == "threshold":
                assert moe.router.warmup_steps == (1 if quick else 20)
    assert " is now moe." not in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["study_routing", "study_topp"])  # their shared command line
def test_unknown_variant_is_one_line_exit_2(tool, tmp_path):
    done = warm_launcher.run([sys.executable, f"tools/{tool}.py", "--variants", "nope",
                              "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "nope" in done.stderr
    assert not (tmp_path / "x").exists()
