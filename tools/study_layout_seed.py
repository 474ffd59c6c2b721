"""A seed defines the run at every layout: the tiny config trained from the same seed (no
`checkpoint.init_from`) at one process and at several parallel layouts, through
`python -m megamoe.train` under torchrun, as a user changes `parallel.*`.

    python tools/study_layout_seed.py --out runs/study_layout_seed            # 8 steps
    python tools/study_layout_seed.py --out /tmp/s --steps 3 --layouts tp2_sp,pp2
    python tools/study_layout_seed.py --out /tmp/s model.hidden_dropout=0.1   # any override

Prints, per layout, the step-1 loss and the largest loss difference from the one-process run
over all steps against the bar (1e-4), and writes OUT/layout_seed.json (every step's loss per
layout) and OUT/layout_seed.png (the curves). Exit code 1 when a layout misses the bar. OUT and
its run folders are marked as the study's (megamoe.ownership): an OUT of anyone else's is refused
in one line before anything trains, and so is a run whose metrics.jsonl cannot be read.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from megamoe.atomic import atomic_write_text
from megamoe.children import end_children_on_sigterm, run_child
from megamoe.errors import CliArgumentParser, ConfigError, DataError, int_at_least, run_cli
from megamoe.ownership import check_folder_output, claim_folder, fresh_folder
from study_routing import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_cpu.yaml"
BAR = 1e-4
TOOL = "study_layout_seed"
LAYOUTS = {  # name -> (processes, parallel overrides)
    "tp2_sp": (2, {"tensor": 2, "expert": 1}),
    "pp2": (2, {"pipeline": 2, "expert": 1}),
    "dp2_ep2": (2, {"expert": 2}),
    "ep2_tp2": (4, {"expert": 2, "tensor": 2}),
    "pp2_vpp2": (2, {"pipeline": 2, "virtual_stages": 2, "expert": 1}),
}


def parse_args(argv):
    parser = CliArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/study_layout_seed", help="study folder")
    parser.add_argument("--steps", type=int_at_least(1), default=8)
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="trainer config overrides of every run")
    args = parser.parse_args(argv)
    args.layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown or not args.layouts:
        raise ConfigError(f"--layouts {unknown or '(empty)'}: choose from {', '.join(LAYOUTS)}")
    check_folder_output(args.out, TOOL, "--out")
    from megamoe.train.config import load_config

    load_config(TINY, args.overrides)  # a bad override: one line here, not after a run
    return args


def train(out: Path, processes: int, parallel: dict, steps: int, overrides: list[str]
          ) -> list[float]:
    """Train the tiny config at one layout in `out` (a fresh folder of the study's); the loss
    of every step."""
    fresh_folder(out, TOOL, "--out")
    launcher = [sys.executable, "-m", "megamoe.train"]
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={processes}", "-m", "megamoe.train"]
    settings = [f"parallel.{key}={value}" for key, value in parallel.items()]
    done = run_child(
        launcher + ["--config", str(TINY), f"output_dir={out}", f"training.train_steps={steps}",
                    "checkpoint.interval=0", "logging.interval=1", "logging.progress_bar=false",
                    "logging.tensorboard=false", *overrides, *settings])
    if done.returncode != 0:
        raise SystemExit(f"the run in {out} failed:\n{done.stderr[-3000:]}")
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    if not losses or not all(isinstance(v, (int, float)) for v in losses):
        raise DataError(f"{out}/metrics.jsonl holds no numeric loss of any step; is it this "
                        "run's?")
    return losses


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, marker="o", label=name, alpha=0.7)
    ax.set(xlabel="step", ylabel="training loss", title="tiny config, one seed, every layout")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = claim_folder(args.out, TOOL, "--out")
    curves = {}
    end_children_on_sigterm()
    runs = [("one_process", 1, {"expert": 1})] + [(n, *LAYOUTS[n]) for n in args.layouts]
    for number, (name, processes, parallel) in enumerate(runs, 1):
        start = time.monotonic()
        print(f"[{number}/{len(runs)}] {name}: {processes} process(es), parallel {parallel}",
              flush=True)
        curves[name] = train(out / name, processes, parallel, args.steps, args.overrides)
        print(f"    done in {time.monotonic() - start:.0f} s", flush=True)
    reference = curves["one_process"]
    print(f"\n{'layout':<14} {'step-1 loss':>12} {'max loss diff vs 1 process':>28}")
    worst = 0.0
    for name, losses in curves.items():
        diff = max(abs(a - b) for a, b in zip(losses, reference))
        worst = max(worst, diff)
        print(f"{name:<14} {losses[0]:>12.5f} {diff:>28.2e}")
    verdict = "meets" if worst <= BAR else "misses"
    print(f"\nlargest difference {worst:.2e}: {verdict} the bar ({BAR:.0e})")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "layout_seed.json",
                      json.dumps({"steps": args.steps, "bar": BAR, "losses": curves}, indent=1))
    plot(curves, out / "layout_seed.png")
    print(f"wrote {out / 'layout_seed.json'} and {out / 'layout_seed.png'}")
    return 0 if worst <= BAR else 1


if __name__ == "__main__":
    run_cli(main)
