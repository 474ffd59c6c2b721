"""SIGKILL of a rank at random moments of a torchrun training run (2 processes, EP=2), one kill
while a checkpoint is being written; after each kill the same command is run again. The
reference is an uninterrupted run of the same config: the final losses of every step must be
bit-identical. Full mode is the issue's claim (300 steps, a checkpoint every 7, six kills);
CI=true runs a short version (24 steps, two kills).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import warm_launcher
from run_harness import (
    QUICK,
    REPO,
    descendants,
    end_processes,
    env,
    step_records,
    train_command,
    wait_for,
)

STEPS, INTERVAL, KILLS = (24, 4, 2) if QUICK else (300, 7, 6)
RUN = (f"training.train_steps={STEPS}", f"checkpoint.interval={INTERVAL}",
       "optimizer.warmup_steps=10")
DETECTION_LIMIT_S = 30.0  # from the SIGKILL to torchrun's exit (about a second when unloaded)


def _last_step(out: Path) -> int:
    """The step of the last complete line of metrics.jsonl (the trainer may be mid-write)."""
    metrics = out / "metrics.jsonl"
    text = metrics.read_text() if metrics.is_file() else ""
    lines = text[:text.rfind("\n") + 1].splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def _saving(out: Path, since: float) -> bool:
    """A checkpoint is being written: a temporary entry created after `since` exists in the
    checkpoint folder."""
    folder = out / "checkpoints"
    try:
        return any("tmp" in p.name.lower() and p.stat().st_ctime > since
                   for p in folder.iterdir())
    except OSError:
        return False


def _workers(launcher_pid: int) -> list[int]:
    """torchrun's trainer processes (its direct children running megamoe.train)."""
    workers = []
    for pid in descendants(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"megamoe.train" in cmdline and Path(f"/proc/{pid}/stat").read_text().split()[3] \
                == str(launcher_pid):
            workers.append(pid)
    return workers


def _kill_one_rank(proc: subprocess.Popen, out: Path, during_save: bool,
                   rng: random.Random) -> float | None:
    """SIGKILL one trainer rank at a random moment (or while a checkpoint is being written);
    returns the seconds until torchrun exited, or None when the run ended before a kill."""
    if during_save:
        started = time.time()
        ready = wait_for(lambda: _saving(out, started), timeout=600, proc=proc, poll=0.002)
    else:
        target = min(_last_step(out) + rng.randint(1, 2 * INTERVAL), STEPS - 2)
        ready = wait_for(lambda: _last_step(out) >= target, timeout=600, proc=proc)
        time.sleep(rng.uniform(0.0, 0.5))  # somewhere inside a step
    workers = _workers(proc.pid)
    if not ready or proc.poll() is not None or not workers:
        proc.wait(timeout=600)
        return None
    tree = descendants(proc.pid)
    killed = time.monotonic()
    os.kill(rng.choice(workers), signal.SIGKILL)
    proc.wait(timeout=600)
    detected = time.monotonic() - killed
    end_processes(tree)  # any child a rank left behind (issue 13 item 5 makes these rare)
    return detected


def test_sigkilled_ranks_resume_bit_identical(corpus_cache, tmp_path):
    reference = tmp_path / "reference"
    # The uninterrupted reference and the final resume need no torchrun of their own: they run
    # warm (tests/warm_launcher.py); the killed runs are real torchrun processes.
    done = warm_launcher.run(train_command(2, corpus_cache, reference, *RUN), cwd=REPO,
                             env=env(), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]

    out, rng = tmp_path / "killed", random.Random(13)
    save_kill = 1  # the second kill waits for a checkpoint being written
    detections, log = [], open(tmp_path / "killed.log", "w")
    for attempt in range(KILLS):
        proc = subprocess.Popen(train_command(2, corpus_cache, out, *RUN), cwd=REPO, env=env(),
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            detected = _kill_one_rank(proc, out, attempt == save_kill, rng)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        assert detected is not None, f"attempt {attempt}: the run ended before the kill"
        assert proc.returncode != 0
        assert detected < DETECTION_LIMIT_S, detections
        detections.append(detected)
    final = warm_launcher.run(train_command(2, corpus_cache, out, *RUN), cwd=REPO, env=env(),
                              timeout=1800)
    assert final.returncode == 0, final.stderr[-3000:]
    print(f"{KILLS} kills; seconds from SIGKILL to torchrun's exit: "
          + ", ".join(f"{d:.2f}" for d in detections))
    resumed, straight = step_records(out), step_records(reference)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[s]["loss"] for s in sorted(resumed)] == \
        [straight[s]["loss"] for s in sorted(straight)]
    assert [resumed[s]["grad_norm"] for s in sorted(resumed)] == \
        [straight[s]["grad_norm"] for s in sorted(straight)]
