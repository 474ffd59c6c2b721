"""Helpers of the training-run fault tests (tests/faults/test_run_*.py): the trainer command, its
environment, metrics, process trees, and a state-recording harness.

As a script, `python run_harness.py RESULT_DIR --config ... [overrides]` (alone or under
torchrun) runs the trainer's own entry point in-process, recording every rank's model state
(parameters and buffers) and optimizer state at the start of each step's forward pass. When the
run ends it writes RESULT_DIR/rank{R}.json: the exit code and whether the state still equals the
last recorded one (NaN equal to NaN), i.e. whether the last step started changed nothing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"
HARNESS = Path(__file__).resolve()
QUICK = os.environ.get("CI", "").lower() == "true"


def env() -> dict:
    return {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def launcher(nproc: int, module_or_script: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, *module_or_script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *module_or_script]


def trainer_args(cache: Path, out: Path, *overrides: str) -> list[str]:
    return ["--config", str(TINY), f"output_dir={out}", f"data.cache_dir={cache}",
            "logging.progress_bar=false", "logging.tensorboard=false", *overrides]


def train_command(nproc: int, cache: Path, out: Path, *overrides: str) -> list[str]:
    """`python -m megamoe.train` (under torchrun when nproc > 1) on the tiny config."""
    return launcher(nproc, ["-m", "megamoe.train"]) + trainer_args(cache, out, *overrides)


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_records(out: Path) -> dict[int, dict]:
    """The last metrics record of each step (a resumed or rolled-back run repeats steps)."""
    return {r["step"]: r for r in lines(out) if "event" not in r}


def events(out: Path) -> list[dict]:
    return [r for r in lines(out) if "event" in r]


def checkpoint_entries(out: Path) -> list[str]:
    folder = out / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), children first."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            frontier += children
    return found


def end_processes(pids: list[int]) -> None:
    """SIGKILL the given processes of ours that are still alive (e.g. orphaned writers)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def wait_for(condition, timeout: float, proc: subprocess.Popen | None = None,
             poll: float = 0.01) -> bool:
    """Poll `condition` until true (True), the timeout or the process's exit (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


# The recording harness (run as a script) -----------------------------------------------------

def _snapshot(run) -> dict:
    import torch

    model = {k: v.detach().clone() for k, v in run.model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    # Megatron's (chained) distributed optimizer: the Adam state of each inner torch optimizer.
    chained = getattr(run.engine.optimizer, "chained_optimizers", [run.engine.optimizer])
    optimizer = {f"{i}.{pid}.{key}": (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                 for i, megatron_optimizer in enumerate(chained)
                 for pid, state in megatron_optimizer.optimizer.state_dict()["state"].items()
                 for key, v in state.items()}
    return {"model": model, "optimizer": optimizer}


def _differences(before: dict, after: dict) -> list[str]:
    import torch

    differ = []
    for part in ("model", "optimizer"):
        for key, old in before[part].items():
            new = after[part].get(key)
            same = (torch.equal(old.isnan(), new.isnan()) and
                    torch.equal(old.nan_to_num(0.0), new.nan_to_num(0.0))
                    if isinstance(old, torch.Tensor) else old == new)
            if not same:
                differ.append(f"{part}:{key}")
    return differ


def _record_main(result_dir: Path, argv: list[str]) -> int:
    from megamoe.train import __main__ as cli
    from megamoe.train import loop

    recorded: dict = {}
    prepare = loop._prepare

    def recording_prepare(*args, **kwargs):
        run = prepare(*args, **kwargs)
        forward_backward = run.engine.forward_backward

        def recording_forward_backward(batches, num_microbatches, step):
            recorded["before"] = _snapshot(run)
            recorded["forwards"] = recorded.get("forwards", 0) + 1
            return forward_backward(batches, num_microbatches, step)

        run.engine.forward_backward = recording_forward_backward
        recorded["run"] = run
        return run

    loop._prepare = recording_prepare
    try:
        cli.main(argv)
        code = 0
    except SystemExit as done:
        code = done.code or 0
    result = {"code": code, "forwards": recorded.get("forwards", 0)}
    if "before" in recorded:
        result["changed"] = _differences(recorded["before"], _snapshot(recorded["run"]))
    rank = os.environ.get("RANK", "0")
    (result_dir / f"rank{rank}.json").write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    result_dir = Path(sys.argv[1])
    result_dir.mkdir(parents=True, exist_ok=True)
    sys.exit(_record_main(result_dir, sys.argv[2:]))
