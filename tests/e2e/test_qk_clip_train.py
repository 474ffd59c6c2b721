"""MuonClip's QK-clip through `python -m megamoe.train` (optimizer.qk_clip_threshold): every
attention layer's max logit is logged each step at data x expert parallel 2, with Muon; a bad
threshold is one line and exit 2. The clip's arithmetic: tests/unit/test_qk_clip.py."""
from __future__ import annotations

import math
import sys

from test_train import REPO, TINY, records, train
import warm_launcher

THRESHOLD = 0.05  # below the tiny model's logits at initialisation (about 0.25)


def test_max_logit_of_every_layer_is_logged_each_step(corpus_cache, tmp_path):
    out = tmp_path / "run"
    train(corpus_cache, out, "training.train_steps=3", "checkpoint.interval=0",
          "optimizer.name=muon", f"optimizer.qk_clip_threshold={THRESHOLD}")
    steps = [r for r in records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    maxima = []
    for record in steps:
        logits = {k: v for k, v in record.items() if k.endswith("/max_logit")}
        assert sorted(logits) == [f"attention/layer{n}/max_logit" for n in range(1, 5)]
        assert all(math.isfinite(v) and v > 0 for v in logits.values())
        maxima.append(max(logits.values()))
    # Clipped to tau on step 1's batch, the heads stay near it on the next batches (the
    # warm-up's learning rate barely moves the weights); unclipped they start near 0.25.
    assert maxima[0] > 2 * THRESHOLD and max(maxima[1:]) < 1.5 * THRESHOLD


def test_bad_threshold_is_one_line_exit_2(tmp_path):
    done = warm_launcher.run([sys.executable, "-m", "megamoe.train", "--config", str(TINY),
                              f"output_dir={tmp_path / 'run'}", "optimizer.qk_clip_threshold=-1"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "optimizer.qk_clip_threshold" in done.stderr and not (tmp_path / "run").exists()
