"""Shared pieces of the checkpoint fault tests: real `python -m megamoe.train` and
`tools/upcycle_ckpt.py` processes on the tiny config, payloads that would leave a marker file if
any unpickler executed them, and the one-line-error check."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import warm_launcher
from shared_builds import build_once

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"
QUICK = os.environ.get("CI", "").lower() == "true"
# 1 process, 3 steps, a checkpoint after each: iter_0000001..3.
SMALL_RUN = ("parallel.expert=1", "training.train_steps=3", "checkpoint.interval=1",
             "checkpoint.keep_last=0", "optimizer.warmup_steps=1", "training.global_batch_size=8",
             "logging.progress_bar=false", "logging.tensorboard=false")


def env() -> dict:
    return {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return warm_launcher.run(args, cwd=REPO, env=env(), capture_output=True, text=True,
                             timeout=timeout)


def train(cache: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """One `python -m megamoe.train` process of the tiny config (SMALL_RUN, then overrides)."""
    return run([sys.executable, "-m", "megamoe.train", "--config", str(TINY),
                f"output_dir={out}", f"data.cache_dir={cache}", *SMALL_RUN, *overrides])


def upcycle(load: Path, save: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "tools/upcycle_ckpt.py", "--load", str(load), "--save",
                str(save), "--num-experts", "4", "--topk", "2", "--no-progress"])


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, no traceback, and a last stderr line `error: ...` holding every fragment."""
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout[-2000:]}\n" \
                                 f"{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], done.stderr[-4000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


class Payload:
    """Unpickling this runs `touch MARKER` (os.system pickles as posix.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class ExecPayload(Payload):
    """The same through builtins.exec."""

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def pickled(obj) -> bytes:
    return pickle.dumps(obj, protocol=4)


# The fixture below is imported by several modules, so each module gets its own instance; it
# keeps its product in the run's base temporary folder to build it only once.

@pytest.fixture(scope="session")
def trained_run(corpus_cache, tmp_path_factory) -> Path:
    """A finished SMALL_RUN: OUTPUT/checkpoints/iter_0000001..3 and the tracker (3)."""
    def build(out: Path) -> None:
        done = train(corpus_cache, out)
        assert done.returncode == 0, done.stderr[-3000:]

    return build_once(tmp_path_factory, "ckpt-trained", build)
