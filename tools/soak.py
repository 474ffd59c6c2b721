"""Soak test: a long CPU training run of the tiny config, sampling every rank's resident memory.

    python tools/soak.py --out /tmp/soak                  # 5,000 steps, 2 processes (EP=2)
    python tools/soak.py --out /tmp/soak --nproc 1        # single process (parallel.expert=1)
    python tools/soak.py --out /tmp/soak --quick          # 300 steps, the CI-sized check

Launches `python -m megamoe.train --config configs/tiny_cpu.yaml` (under torchrun when
`--nproc` > 1) and reads the resident set size (VmRSS of /proc/PID/status) of every trainer
process each time the run's metrics.jsonl passes a multiple of `--sample-every` steps. Writes
OUT/soak.json (the samples and the summary) and OUT/soak_rss.png, and prints the growth of the
total RSS from the end of the warm-up to the end of the run against the bar: flat within 5%
after warm-up. Exit code 1 when the run fails or the growth exceeds the bar. OUT is marked as
the soak test's (megamoe.ownership); a folder of anyone else's is refused in one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megamoe.bounded import bounded_lines
from megamoe.errors import CliArgumentParser, ConfigError, int_at_least, run_cli
from megamoe.ownership import check_folder_output, claim_folder

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_cpu.yaml"
BAR_PERCENT = 5.0
MAX_RECORD_BYTES = 16 << 20  # one metrics line
TOOL = "soak"


def parse_args(argv):
    parser = CliArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="run folder (metrics, checkpoints, plot)")
    parser.add_argument("--steps", type=int_at_least(1), default=5000)
    parser.add_argument("--quick", action="store_true", help="300 steps, warm-up 100")
    parser.add_argument("--nproc", type=int_at_least(1), default=2,
                        help="trainer processes (torchrun)")
    parser.add_argument("--sample-every", type=int_at_least(1), default=100,
                        help="steps between samples")
    parser.add_argument("--warmup", type=int_at_least(0), default=None,
                        help="steps before the baseline sample (default: 10%% of the steps, "
                             "at least one sample interval)")
    parser.add_argument("--checkpoint-interval", type=int_at_least(0), default=1000)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="extra trainer config overrides")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 300, 100
    if args.warmup is None:
        args.warmup = max(args.sample_every, args.steps // 10)
    if args.warmup >= args.steps:
        raise ConfigError(f"--warmup={args.warmup} must be below --steps={args.steps} (its "
                          "default: --sample-every or a tenth of the steps, the larger)")
    check_folder_output(args.out, TOOL, "--out")
    from megamoe.train.config import load_config

    load_config(TINY, trainer_overrides(args))  # a bad override: one line here, no run
    return args


def trainer_overrides(args) -> list[str]:
    return [f"output_dir={Path(args.out) / 'run'}", f"training.train_steps={args.steps}",
            f"checkpoint.interval={args.checkpoint_interval}", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.interval=100",
            *([] if args.nproc > 1 else ["parallel.expert=1"]), *args.overrides]


def trainer_command(args) -> list[str]:
    launcher = [sys.executable, "-m", "megamoe.train"]
    if args.nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={args.nproc}", "-m", "megamoe.train"]
    return launcher + ["--config", str(TINY), *trainer_overrides(args)]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def trainer_pids(root: int, nproc: int) -> list[int]:
    """The trainer processes: `root` itself alone, or torchrun's worker children."""
    return [root] if nproc == 1 else sorted(_children(root))


def steps_done(metrics: Path) -> int:
    """The step of the run's last complete metrics record (0 before the first)."""
    step = 0
    if metrics.is_file():
        for _, line in bounded_lines(metrics, MAX_RECORD_BYTES, ConfigError, str(metrics)):
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue  # an event record, or a line being written
    return step


def summarise(samples: list[dict], warmup: int) -> dict:
    """Total RSS at the first sample at or after `warmup` and at the last, and the growth."""
    after = [s for s in samples if s["step"] >= warmup]
    if len(after) < 2:
        raise ConfigError(f"fewer than two samples after the warm-up of {warmup} steps")
    base, end = after[0], after[-1]
    growth = 100.0 * (end["total_mib"] - base["total_mib"]) / base["total_mib"]
    peak = max(s["total_mib"] for s in after)
    return {"warmup_step": base["step"], "warmup_total_mib": base["total_mib"],
            "end_step": end["step"], "end_total_mib": end["total_mib"],
            "peak_after_warmup_mib": peak, "growth_percent": growth,
            "max_growth_percent": 100.0 * (peak - base["total_mib"]) / base["total_mib"],
            "bar_percent": BAR_PERCENT, "flat": abs(growth) <= BAR_PERCENT}


def plot(samples: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps = [s["step"] for s in samples]
    for rank in range(len(samples[0]["rss_mib"])):
        ax.plot(steps, [s["rss_mib"][rank] for s in samples], marker=".", label=f"rank {rank}")
    ax.axvline(summary["warmup_step"], color="grey", linestyle="--", label="end of warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title(f"soak: RSS growth after warm-up {summary['growth_percent']:+.2f}% "
                 f"(bar: within {BAR_PERCENT:.0f}%)")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)


def soak(args) -> int:
    out = claim_folder(args.out, TOOL, "--out")
    metrics = out / "run" / "metrics.jsonl"
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    log = open(out / "trainer.log", "a", encoding="utf-8")
    proc = subprocess.Popen(trainer_command(args), cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    samples, next_sample, start = [], args.sample_every, time.monotonic()
    print(f"soak: {args.steps} steps on {args.nproc} process(es), log {out / 'trainer.log'}",
          flush=True)
    while proc.poll() is None:
        step = steps_done(metrics)
        if step >= next_sample:
            rss = [_rss_kib(pid) for pid in trainer_pids(proc.pid, args.nproc)]
            if len(rss) == args.nproc and None not in rss:
                mib = [r / 1024 for r in rss]
                samples.append({"step": step, "elapsed_s": time.monotonic() - start,
                                "rss_mib": mib, "total_mib": sum(mib)})
                print(f"step {step}: RSS " + " + ".join(f"{m:.1f}" for m in mib) +
                      f" MiB ({time.monotonic() - start:.0f} s)", flush=True)
            next_sample = (step // args.sample_every + 1) * args.sample_every
        time.sleep(0.05)
    log.close()
    if proc.returncode != 0:
        print(f"soak: the trainer exited {proc.returncode}; see {out / 'trainer.log'}",
              file=sys.stderr)
        return 1
    summary = summarise(samples, args.warmup)
    summary.update(steps=args.steps, nproc=args.nproc,
                   seconds=time.monotonic() - start)
    result = out / "soak.json"
    result.with_suffix(".tmp").write_text(json.dumps({"summary": summary, "samples": samples},
                                                     indent=1))
    os.replace(result.with_suffix(".tmp"), result)
    plot(samples, summary, out / "soak_rss.png")
    print(f"RSS (all ranks) at step {summary['warmup_step']} (end of warm-up): "
          f"{summary['warmup_total_mib']:.1f} MiB; at step {summary['end_step']}: "
          f"{summary['end_total_mib']:.1f} MiB; growth {summary['growth_percent']:+.2f}% "
          f"(peak {summary['max_growth_percent']:+.2f}%); bar: flat within {BAR_PERCENT:.0f}% "
          f"-> {'PASS' if summary['flat'] else 'FAIL'}")
    print(f"wrote {result} and {out / 'soak_rss.png'}")
    return 0 if summary["flat"] else 1


def main(argv=None) -> int:
    return soak(parse_args(argv))


if __name__ == "__main__":
    run_cli(main)
