"""No process of a run outlives it: a 2-rank torchrun training is SIGKILLed on one rank after
its first checkpoint (so Megatron-Core's checkpoint writer has started its helper processes);
once torchrun has exited, no process carrying the run's marker environment variable remains."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ckpt_fault_helpers import REPO, TINY, env

MARKER = "MEGAMOE_ORPHAN_TEST"


def _processes_with(tag: str) -> dict[int, str]:
    """pid -> command line of every process whose environment holds MARKER=tag."""
    found = {}
    needle = f"{MARKER}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                    b"\0", b" ").decode(errors="replace")[:200]
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


def _rank_pid(tag: str, rank: str) -> int | None:
    for pid in _processes_with(tag):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if f"RANK={rank}".encode() in environ and b"-m megamoe.train" in \
                Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") and \
                b"torch.distributed.run" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None


def test_sigkill_of_a_rank_leaves_no_process(corpus_cache, tmp_path):
    tag = uuid.uuid4().hex
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "-m", "megamoe.train", "--config", str(TINY),
               f"output_dir={out}", f"data.cache_dir={corpus_cache}", "training.train_steps=500",
               "checkpoint.interval=1", "logging.progress_bar=false",
               "logging.tensorboard=false"]
    proc = subprocess.Popen(command, cwd=REPO, env={**env(), MARKER: tag},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        tracker = out / "checkpoints" / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + 240
        while not tracker.is_file():
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.5)
        helpers = _processes_with(tag)
        assert len(helpers) > 3, helpers  # torchrun, 2 ranks, their checkpoint helpers
        victim = _rank_pid(tag, "1")
        assert victim is not None, helpers
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=180)
        deadline = time.monotonic() + 15
        while _processes_with(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _processes_with(tag) == {}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _processes_with(tag):  # never leave them behind, even when failing
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
