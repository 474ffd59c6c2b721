"""tools/study_layout_seed.py end to end: the tiny config from one seed at one process and at
PP=2 (different pipeline stages draw different layers) through `python -m megamoe.train`, every
step's loss within the bar; a bad layout name is refused in one line."""
import json
import sys
from pathlib import Path
import warm_launcher

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_layout_follows_the_one_process_curve(tmp_path, corpus_cache):
    out = tmp_path / "study"
    done = warm_launcher.run([sys.executable, "tools/study_layout_seed.py", "--out", str(out),
                              "--steps", "2", "--layouts", "pp2", f"data.cache_dir={corpus_cache}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    losses = json.loads((out / "layout_seed.json").read_text())["losses"]
    assert set(losses) == {"one_process", "pp2"} and len(losses["pp2"]) == 2
    assert max(abs(a - b) for a, b in zip(losses["pp2"], losses["one_process"])) <= 1e-4
    assert (out / "layout_seed.png").stat().st_size > 1000
    assert "meets the bar" in done.stdout


def test_an_unknown_layout_is_refused_in_one_line(tmp_path):
    done = warm_launcher.run([sys.executable, "tools/study_layout_seed.py", "--out", str(tmp_path),
                              "--layouts", "pp3"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert done.returncode == 2
    assert "pp3" in done.stderr and "choose from" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())
