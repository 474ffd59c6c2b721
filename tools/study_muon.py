"""Muon study: does Muon reach a lower held-out loss than AdamW at equal steps on the small MoE?

    python tools/study_muon.py [--out runs/study_muon] [--quick] [--jobs N] [--runs DIR]
                               [--seeds 1234,1235] [--adamw-lrs a,b,c] [--muon-lrs a,b,c]

Results go to runs/ unless `--out` says otherwise; the published study is
`--out docs/muon-study` (its study.md and study.json are docs/muon-study.md and .json), so a
`--quick` check never overwrites it.

Muon ("Muon is Scalable for LLM Training", Moonlight, arXiv 2502.16982) claims about twice
AdamW's compute efficiency. The test, every run from the same data order per seed through the
public entry (`python -m megamoe.train --config BASE key=value ...`, `--jobs` at a time, one
intra-op thread each):
- the routing study's small MoE (tools/study_routing.py: 4 layers, the first dense, 3 MoE
  layers of 8 experts, the embedded corpus with 5% held out), STEPS steps of 2,048 tokens,
  linear warm-up then a constant learning rate, held-out loss every EVAL_INTERVAL steps;
- `optimizer.name=adamw` and `optimizer.name=muon`, each over its learning-rate grid (factors
  of 2, overlapping) and every seed; Muon with Moonlight's update scaling (update RMS 0.2, as
  AdamW's: its rates are of AdamW's order) and the same weight decay 0.1; in Muon runs the
  embeddings, output layer, norms and routers train with AdamW at the same rate
  (megamoe.optim);
- each optimizer's best rate: the lowest held-out loss at the last step, averaged over the
  seeds; the study checks that it is interior to its grid (an optimum at the edge says the grid
  must be extended, and the study says so);
- at equal steps: each seed's held-out loss of Muon against AdamW, both at their best rate;
- the step ratio: AdamW at its best rate trained for LONG_FACTOR x STEPS (a constant rate, so
  its first STEPS steps follow the grid run's schedule), and the first step at which its
  held-out loss reaches Muon's final one (linear between evaluations), over STEPS, is how many
  times the steps AdamW needs. Megatron's dataset orders the samples for the run's whole
  length, so the longer run sees another data order: its loss at STEPS is shown beside the grid
  run's, a measure of the data-order noise in the ratio.
OUT gets study.md (the table), study.json (settings, every run's final loss, the best rates,
per-seed comparisons and ratios), curves.csv (every held-out evaluation: run, optimizer, lr,
seed, step, heldout_loss; plot-able), heldout_loss.png and base.yaml, written atomically; runs
train in a temporary folder or in `--runs DIR`, where a finished run is reused (see
tools/study_routing.py for the folder marks). `--quick` (CI) trains a few steps of a small batch
with one seed: it checks the pipeline, not the claim.
"""
from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import math
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from megamoe.children import end_children_on_sigterm
from megamoe.errors import CliArgumentParser, int_at_least, run_cli
from megamoe.ownership import claim_folder
from study_routing import BASE_CONFIG as ROUTING_BASE
from study_routing import (check_outputs, publish, read_metrics, series, study_folder,
                           summarise_runs, train_run)

STUDY = "study_muon"
STEPS = 400
LONG_FACTOR = 2
EVAL_INTERVAL = 25
OPTIMIZERS = ("adamw", "muon")
SEEDS = (1234, 1235)
# A probe of one seed at 400 steps put AdamW's best near 2e-3 (higher rates stay longer in the
# early phase where every token shares one hidden state) and Muon's near 4e-3-8e-3.
LRS = {"adamw": (5.0e-4, 1.0e-3, 2.0e-3, 4.0e-3), "muon": (2.0e-3, 4.0e-3, 8.0e-3, 1.6e-2)}

BASE_CONFIG = copy.deepcopy(ROUTING_BASE)
BASE_CONFIG["training"].update({"train_steps": STEPS, "micro_batch_size": 32,
                                "global_batch_size": 32})
# Constant after warm-up: a longer AdamW run passes through the grid run's states.
BASE_CONFIG["optimizer"] = {"lr": 1.0e-3, "min_lr": 0.0, "warmup_steps": 30,
                            "decay_style": "constant", "weight_decay": 0.1}
BASE_CONFIG["evaluation"] = {"interval": EVAL_INTERVAL, "batches": 8}
QUICK_STEPS = 4
QUICK = ["training.micro_batch_size=4", "training.global_batch_size=4",
         "data.vocab_size=4096",  # the default corpus other tests build anyway
         "evaluation.interval=2", "evaluation.batches=1", "optimizer.warmup_steps=1"]
QUICK_LRS = {"adamw": (1.0e-3, 3.0e-3, 1.0e-2), "muon": (1.0e-3, 3.0e-3, 1.0e-2)}


def learning_rates(text: str) -> tuple[float, ...]:
    """A --*-lrs value: at least 3 distinct positive finite rates, comma-separated (sorted)."""
    try:
        rates = tuple(sorted({float(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        rates = ()
    if len(rates) < 3 or not all(math.isfinite(r) and r > 0 for r in rates):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a grid of learning rates: give at least 3 distinct positive "
            "numbers, comma-separated (the best must be interior)")
    return rates


def seed_list(text: str) -> tuple[int, ...]:
    """A --seeds value: distinct non-negative integers, comma-separated."""
    try:
        seeds = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        seeds = ()
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of seeds: give non-negative "
                                         "integers, comma-separated, e.g. 1234,1235")
    return seeds


def arguments(argv) -> argparse.Namespace:
    parser = CliArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "runs"
                                             / STUDY),
                        help=f"result folder (default runs/{STUDY}; published: docs/muon-study)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps of 256 tokens, one seed (CI)")
    parser.add_argument("--jobs", type=int_at_least(1), default=1,
                        help="runs trained at a time, one thread each (default 1)")
    parser.add_argument("--runs", help="train (and reuse finished runs) here, kept afterwards")
    parser.add_argument("--seeds", type=seed_list, help="default 1234,1235 (--quick: 1234)")
    for name in OPTIMIZERS:
        parser.add_argument(f"--{name}-lrs", type=learning_rates,
                            help=f"{name}'s learning-rate grid (default "
                                 f"{','.join(f'{r:g}' for r in LRS[name])})")
    args = parser.parse_args(argv)
    args.study = STUDY
    args.seeds = args.seeds or (SEEDS[:1] if args.quick else SEEDS)
    args.lrs = {name: getattr(args, f"{name}_lrs") or (QUICK_LRS if args.quick else LRS)[name]
                for name in OPTIMIZERS}
    args.steps = QUICK_STEPS if args.quick else STEPS
    grid = [run_name(o, lr, s) for o in OPTIMIZERS for lr in args.lrs[o] for s in args.seeds]
    args.names = grid + [run_name("adamw", lr, s, long=True)
                         for lr in args.lrs["adamw"] for s in args.seeds]
    return args


def run_name(optimizer: str, lr: float, seed: int, long: bool = False) -> str:
    return f"{optimizer}{'_long' if long else ''}_lr{lr:g}_seed{seed}"


def overrides(args: argparse.Namespace, optimizer: str, lr: float, seed: int,
              steps: int) -> list[str]:
    return [f"optimizer.name={optimizer}", f"optimizer.lr={lr}", f"training.seed={seed}",
            f"training.train_steps={steps}", *(QUICK if args.quick else [])]


def train_all(args: argparse.Namespace, jobs: list[tuple[str, list[str], int]], base_yaml: Path,
              runs: Path) -> dict[str, Path]:
    """Train (name, overrides, steps) `jobs`, `args.jobs` at a time; the folders of those that
    finished (a failed run is reported by `train_run` and left out)."""
    def train(job):
        name, extra, steps = job
        return train_run(name, extra, base_yaml, runs, steps, STUDY)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        folders = dict(zip([j[0] for j in jobs], pool.map(train, jobs)))
    return {n: f for n, f in folders.items() if f is not None}


def summarise(records: list[dict]) -> dict:
    """A run's held-out curve, final held-out loss, median and total step time."""
    kept = [r for r in records if "heldout_loss" in r]
    return {"curve": [[r["step"], r["heldout_loss"]] for r in kept],
            "heldout_loss": kept[-1]["heldout_loss"],
            "last_step": records[-1]["step"],
            "step_time_s": statistics.median(series(records, "step_time_s")),
            "train_time_s": sum(series(records, "step_time_s"))}


def at_step(curve: list[list[float]], step: int) -> float:
    """The held-out loss a curve logged at `step` (NaN when it has none there)."""
    return next((loss for s, loss in curve if s == step), float("nan"))


def steps_to_reach(curve: list[list[float]], target: float) -> float | None:
    """The first step at which the held-out `curve` ([step, loss] pairs) reaches `target`,
    linear between evaluations; None when it never does."""
    previous = None
    for step, loss in curve:
        if loss <= target:
            if previous is None:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def best_rates(args: argparse.Namespace, rows: dict[str, dict]) -> dict[str, dict]:
    """Per optimizer: the mean final held-out loss of each rate over the seeds (NaN where a
    run failed), the best rate and whether it is interior to the grid."""
    out = {}
    for name in OPTIMIZERS:
        grid = args.lrs[name]
        means = []
        for lr in grid:
            losses = [rows[n]["heldout_loss"] for n in (run_name(name, lr, s) for s in args.seeds)
                      if n in rows and rows[n]["last_step"] == args.steps]
            means.append(statistics.fmean(losses) if len(losses) == len(args.seeds)
                         else float("nan"))
        finite = [i for i, m in enumerate(means) if math.isfinite(m)]
        best = min(finite, key=lambda i: means[i]) if finite else None
        out[name] = {"grid": list(grid), "mean_heldout_loss": means,
                     "best_lr": grid[best] if best is not None else None,
                     "interior": best is not None and 0 < best < len(grid) - 1}
    return out


def compare(args: argparse.Namespace, rows: dict[str, dict], best: dict) -> list[dict]:
    """Per seed, at the best rates: both final held-out losses, the AdamW long run's loss at
    STEPS (beside its grid run's: the same schedule, another data order) and the step
    ratio."""
    out = []
    for seed in args.seeds:
        adamw = rows.get(run_name("adamw", best["adamw"]["best_lr"], seed))
        muon = rows.get(run_name("muon", best["muon"]["best_lr"], seed))
        long = rows.get(run_name("adamw", best["adamw"]["best_lr"], seed, long=True))
        entry = {"seed": seed, "adamw": adamw and adamw["heldout_loss"],
                 "muon": muon and muon["heldout_loss"]}
        if adamw and muon:
            entry["muon_below_adamw"] = muon["heldout_loss"] < adamw["heldout_loss"]
        if long and muon:
            reached = steps_to_reach(long["curve"], muon["heldout_loss"])
            entry.update({
                "adamw_long_at_steps": at_step(long["curve"], args.steps),
                "adamw_steps_to_muon_final": reached,
                "step_ratio": reached / args.steps if reached is not None else None,
                "long_steps": long["last_step"]})
        out.append(entry)
    return out


def ratio_text(entry: dict) -> str:
    if "long_steps" not in entry:
        return "n/a (a run failed)"
    if entry["step_ratio"] is None:
        return f"> {LONG_FACTOR} (not reached in {entry['long_steps']} steps)"
    return f"{entry['step_ratio']:.2f}"


def claim_lines(args: argparse.Namespace, best: dict, seeds: list[dict]) -> list[str]:
    """One line per claim: the grids' optima interior, Muon below AdamW at equal steps on
    every seed, and the step ratios."""
    lines = []
    for name in OPTIMIZERS:
        b = best[name]
        where = ("interior to its grid" if b["interior"] else
                 f"AT THE EDGE of its grid {b['grid']}: extend --{name}-lrs past it")
        lines.append(f"{name}: best learning rate {b['best_lr']} ({where})")
    wins = [e.get("muon_below_adamw") for e in seeds]
    verdict = ("HELD" if all(w is True for w in wins) else
               "DID NOT HOLD" if any(w is False for w in wins) else "NOT RUN")
    numbers = "; ".join(f"seed {e['seed']}: Muon {e['muon']:.4f} vs AdamW {e['adamw']:.4f}"
                        for e in seeds if "muon_below_adamw" in e)
    lines.append(f"{verdict}: Muon's held-out loss below AdamW's at {args.steps} steps on every "
                 f"seed, each at its best rate ({numbers})")
    lines.append("steps AdamW needs to reach Muon's final held-out loss, over "
                 f"{args.steps}: " + ", ".join(f"seed {e['seed']}: {ratio_text(e)}"
                                              for e in seeds))
    return lines


def markdown(args, rows, best, seeds, lines, settings) -> str:
    out = ["# Muon vs AdamW study", "", settings, "",
           "## Final held-out loss by learning rate (mean over seeds; per seed in study.json)",
           "", "| optimizer | lr | " + " | ".join(f"seed {s}" for s in args.seeds)
           + " | mean | best |",
           "|---|---|" + "---|" * len(args.seeds) + "---|---|"]
    for name in OPTIMIZERS:
        b = best[name]
        for lr, mean in zip(b["grid"], b["mean_heldout_loss"]):
            per_seed = [rows.get(run_name(name, lr, s), {}).get("heldout_loss", float("nan"))
                        for s in args.seeds]
            out.append(f"| {name} | {lr:g} | " + " | ".join(f"{v:.4f}" for v in per_seed)
                       + f" | {mean:.4f} | {'**best**' if lr == b['best_lr'] else ''} |")
    out += ["", f"## At equal steps ({args.steps}), each optimizer at its best rate", "",
            "| seed | AdamW | Muon | Muon - AdamW | AdamW long run at the same step "
            "(its data order differs) | "
            "AdamW steps to Muon's final loss / steps |", "|---|---|---|---|---|---|"]
    for e in seeds:
        if "muon_below_adamw" not in e:
            out.append(f"| {e['seed']} | (a run failed) | | | | |")
            continue
        out.append(f"| {e['seed']} | {e['adamw']:.4f} | {e['muon']:.4f} | "
                   f"{e['muon'] - e['adamw']:+.4f} | "
                   f"{e.get('adamw_long_at_steps', float('nan')):.4f} | {ratio_text(e)} |")
    out += ["", f"Each run's step times are in study.json; trained {args.jobs} at a time on "
            "shared cores, they do not compare the optimizers' cost: `python "
            "tools/bench_muon.py --config OUT/base.yaml` times both alone.", "", "## Claims", ""]
    out += [f"- {line}" for line in lines]
    out += ["", "![held-out loss](heldout_loss.png)", ""]
    return "\n".join(out)


def curves_csv(rows: dict[str, dict], meta: dict[str, tuple]) -> str:
    """Every held-out evaluation of every run, one row each."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["run", "optimizer", "lr", "seed", "step", "heldout_loss"])
    for name, row in rows.items():
        optimizer, lr, seed = meta[name]
        for step, loss in row["curve"]:
            writer.writerow([name, optimizer, lr, seed, step, loss])
    return text.getvalue()


def plot(args, rows: dict[str, dict], best: dict, out: Path) -> None:
    """Held-out loss against step at each optimizer's best rate, one line per seed (the AdamW
    long run for AdamW)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, colour in zip(OPTIMIZERS, ("tab:blue", "tab:red")):
        for seed, style in zip(args.seeds, ("-", "--", ":", "-.")):
            lr = best[name]["best_lr"]
            row = rows.get(run_name(name, lr, seed, long=True)) or rows.get(
                run_name(name, lr, seed))
            if row:
                steps, losses = zip(*row["curve"])
                ax.plot(steps, losses, style, color=colour, lw=1,
                        label=f"{name} lr {lr:g}, seed {seed}")
    ax.axvline(args.steps, color="k", ls=":", lw=0.8)
    ax.set_xlabel("step"), ax.set_ylabel("held-out loss"), ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "heldout_loss.png", dpi=60)
    plt.close(fig)


def main(argv=None) -> int:
    args = arguments(argv)
    check_outputs(args, args.steps)
    out, work = study_folder(args.out)
    end_children_on_sigterm()
    started = time.perf_counter()
    try:
        base_yaml = work / "base.yaml"
        base_yaml.write_text(yaml.safe_dump(BASE_CONFIG, sort_keys=False))
        runs = claim_folder(args.runs or work / "runs", STUDY, "--runs")
        meta = {run_name(o, lr, s): (o, lr, s)
                for o in OPTIMIZERS for lr in args.lrs[o] for s in args.seeds}
        grid = [(n, overrides(args, o, lr, s, args.steps), args.steps)
                for n, (o, lr, s) in meta.items()]
        folders = train_all(args, grid, base_yaml, runs)
        rows = summarise_runs({n: read_metrics(f) for n, f in folders.items()}, folders,
                              summarise)
        best = best_rates(args, rows)
        lr = best["adamw"]["best_lr"]
        if lr is not None:
            long = {run_name("adamw", lr, s, long=True): ("adamw", lr, s) for s in args.seeds}
            meta.update(long)
            folders = train_all(args, [(n, overrides(args, "adamw", lr, s,
                                                     LONG_FACTOR * args.steps),
                                        LONG_FACTOR * args.steps)
                                       for n, (_, _, s) in long.items()], base_yaml, runs)
            rows.update(summarise_runs({n: read_metrics(f) for n, f in folders.items()},
                                       folders, summarise))
        if best["muon"]["best_lr"] is None or lr is None:
            print(f"{STUDY}: no learning rate of an optimizer finished on every seed; nothing "
                  "written", file=sys.stderr)
            return 1
        seeds = compare(args, rows, best)
        lines = claim_lines(args, best, seeds)
        failed = [n for n in meta if n not in rows]
        settings = (f"{'QUICK (pipeline check only) ' if args.quick else ''}"
                    f"{len(rows)} runs ({len(args.seeds)} seed(s) x grids of "
                    f"{len(args.lrs['adamw'])} AdamW and {len(args.lrs['muon'])} Muon rates, "
                    f"{args.steps} steps each, plus AdamW at its best rate for "
                    f"{LONG_FACTOR * args.steps} steps), "
                    f"{sum(r['train_time_s'] for r in rows.values()):.0f} s of training steps in "
                    f"all (this invocation {time.perf_counter() - started:.0f} s, {args.jobs} at "
                    "a time, finished runs reused); base config `base.yaml`, per-run "
                    "overrides: optimizer.name, optimizer.lr, training.seed, "
                    "training.train_steps." + (f" FAILED runs: {', '.join(failed)}."
                                               if failed else ""))
        (work / "study.md").write_text(markdown(args, rows, best, seeds, lines, settings))
        (work / "study.json").write_text(json.dumps(
            {"settings": settings, "steps": args.steps, "long_steps": LONG_FACTOR * args.steps,
             "seeds": list(args.seeds), "base_config": BASE_CONFIG,
             "quick_overrides": QUICK if args.quick else [], "best": best, "at_equal_steps": seeds,
             "runs": {n: {"optimizer": meta[n][0], "lr": meta[n][1], "seed": meta[n][2], **r}
                      for n, r in rows.items()},
             "claims": lines}, indent=1))
        (work / "curves.csv").write_text(curves_csv(rows, meta))
        plot(args, rows, best, work)
        publish(work, out, STUDY)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for line in lines:
        print(line)
    print(f"study written to {out}/study.md")
    return 1 if failed else 0


if __name__ == "__main__":
    run_cli(main)
