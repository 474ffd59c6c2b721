"""Per-step cost of Muon against AdamW on the tiny config, through the real trainer.

    python tools/bench_muon.py [--config configs/tiny_cpu.yaml] [--steps 20] [--nproc 1]
                               [--data-cache DIR] [SETTING=VALUE ...]

Trains the config for `--steps` steps twice from the same seed, `optimizer.name=adamw` then
`optimizer.name=muon` (no checkpoints, a temporary output folder each), with `--nproc`
processes (1: `parallel.expert=1`; more: torchrun and the config's layout), and prints each
run's median step time over the steps after the first quarter (warm) from its metrics.jsonl,
and Muon's over AdamW's. Extra SETTING=VALUE overrides go to both runs. Each process runs one
intra-op thread unless OMP_NUM_THREADS is set.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from megamoe.bounded import bounded_lines
from megamoe.children import run_child
from megamoe.errors import CliArgumentParser, DataError, int_at_least, run_cli

ROOT = Path(__file__).resolve().parents[1]
MAX_RECORD_BYTES = 1 << 20


def _command(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "megamoe.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "megamoe.train"]


def step_times(out: Path) -> list[float]:
    """step_time_s of every step record of `out`/metrics.jsonl, in order."""
    path = out / "metrics.jsonl"
    times = []
    for number, line in bounded_lines(path, MAX_RECORD_BYTES, DataError, str(path)):
        record = json.loads(line) if line.strip() else {}
        if "step_time_s" in record and "event" not in record:
            times.append(float(record["step_time_s"]))
    return times


def run(optimizer: str, args, root: Path) -> float:
    """Median warm step time (s) of one run with `optimizer`."""
    out = root / optimizer
    overrides = [f"output_dir={out}", f"optimizer.name={optimizer}",
                 f"training.train_steps={args.steps}", "checkpoint.interval=0",
                 "logging.interval=1", "logging.progress_bar=false",
                 "logging.tensorboard=false", *args.settings]
    if args.nproc == 1:
        overrides.append("parallel.expert=1")
    if args.data_cache:
        overrides.append(f"data.cache_dir={args.data_cache}")
    # One intra-op thread per process unless OMP_NUM_THREADS says otherwise: on a shared CPU
    # spinning threads make small matrix products (Newton-Schulz's) erratic.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "TORCHDYNAMO_DISABLE": "1"}
    done = run_child(_command(args.nproc) + ["--config", str(args.config), *overrides],
                     cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{optimizer} run failed (exit {done.returncode}): "
                         f"{done.stderr.strip()[-2000:]}")
    times = step_times(out)
    return statistics.median(times[len(times) // 4:])


def main(argv=None) -> int:
    parser = CliArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny_cpu.yaml")
    parser.add_argument("--steps", type=int_at_least(4), default=20)
    parser.add_argument("--nproc", type=int_at_least(1), default=1)
    parser.add_argument("--data-cache", type=Path, default=None)
    parser.add_argument("settings", nargs="*", help="SETTING=VALUE overrides for both runs")
    args = parser.parse_args(argv)
    from megamoe.train.config import load_config

    for optimizer in ("adamw", "muon"):  # a bad config or setting: one line here, no run
        load_config(args.config, [f"optimizer.name={optimizer}", *args.settings])
    with tempfile.TemporaryDirectory(prefix="bench_muon_") as tmp:
        adamw, muon = (run(name, args, Path(tmp)) for name in ("adamw", "muon"))
    print(f"{args.config.name}, {args.nproc} process(es), median warm step: "
          f"AdamW {adamw * 1e3:.1f} ms, Muon {muon * 1e3:.1f} ms "
          f"(x{muon / adamw:.2f}, +{(muon - adamw) * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    run_cli(main)
