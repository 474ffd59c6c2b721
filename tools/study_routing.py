"""Routing study: the same small MoE trained under each router and balancer, and whether each
paper's claim holds at this scale.

    python tools/study_routing.py [--out runs/study_routing] [--quick] [--jobs N]
                                  [--variants a,b,...] [--runs DIR]

Results go to runs/ unless `--out` says otherwise; the published full study is
`--out docs/study_routing`, so a `--quick` check never overwrites it.

Every variant trains the study's default model (a 4-layer GPT, first layer dense, 3 MoE layers
of 8 experts, on the embedded corpus with 5% of its documents held out) with the same seed and
data order through the public entry `python -m megamoe.train --config BASE key=value ...`,
`--jobs` processes at a time (one intra-op thread each), and is read back from its
metrics.jsonl. The study writes, atomically,
OUT/study.md and OUT/study.json (the table and the claims), OUT/*.png (held-out loss, MaxVio
global and per micro-batch per layer, experts per token per layer, dropped tokens, step time)
and OUT/base.yaml; the runs themselves train in a temporary folder that is removed, or in
`--runs DIR`, where a variant whose run already finished is read back
instead of trained again, so an interrupted study resumes. OUT, DIR and each run folder in it
are marked as the study's (megamoe.ownership): the study replaces only folders it marked (or
empty ones) and refuses any other in one line, before anything trains; a run it cannot read
(a malformed metrics.jsonl or config.yaml) is refused in one line too. Each claim is printed as
one line saying whether it held. `--quick` (CI) trains a few steps of a smaller batch: it checks
the pipeline, not the claims.

Claims (research notes; papers cited in megamoe.routing / megamoe.balancing):
- loss-free bias (arXiv 2408.15664): much lower MaxVio_global than the aux loss at no worse
  held-out loss; the bar: MaxVio_global <= 0.05 (last 50 steps, mean over layers) and held-out
  loss within 0.01 of the aux-loss run. The paper's MaxVio_global counts the load over a whole
  evaluation set and its MaxVio_batch over one training batch; here MaxVio_global pools the
  expert loads of the last 50 training steps (409,600 tokens), and the table also gives the
  mean per-step MaxVio, whose floor at 8,192 tokens a step is sampling noise (printed beside the
  table: what independent, perfectly balanced tokens would show);
- dynamic top-p (arXiv 2403.07652): fewer than 2 experts per token at a held-out loss no worse
  than top-2 by more than 1%, and more experts in lower layers;
- expert-threshold routing (arXiv 2603.11535): balances without an aux loss and beats
  token-choice top-k at equal average experts per token;
- Sinkhorn / BASE: near-perfect balance by construction;
- Skywork-MoE (arXiv 2406.06563): the gating-logit normalisation sharpens the gate
  distribution (mean max gate) and the adaptive coefficient lowers the drop rate;
- quantile balancing (Kimi K3, Megatron-Core's `quantile_balancing`): balance at least as good
  as the loss-free bias (MaxVio_global pooled and per step) with no rate to tune, at a
  held-out loss within 0.01 of it, on each of two seeds (variants `*_seed2`; `quantile_ema`, its
  bias blended with EMA 0.9, is a sensitivity row, not the claim). The published comparison is
  `--out docs/study_quantile --variants quantile,bias,aux_loss,quantile_ema,quantile_seed2,
  bias_seed2,aux_loss_seed2,quantile_ema_seed2`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import yaml

from megamoe.balancing import maxvio
from megamoe.bounded import bounded_lines, parse_json, parse_yaml, read_bounded
from megamoe.children import end_children_on_sigterm, run_child
from megamoe.errors import CliArgumentParser, ConfigError, DataError, int_at_least, run_cli
from megamoe.ownership import check_folder_output, claim_folder, fresh_folder, replace_folder
from megamoe.paths import refuse_overlap

ROOT = Path(__file__).resolve().parent.parent
TAIL = 50  # steps averaged for the table ("last 50 steps")
MAX_RECORD_BYTES = 16 * 2**20  # one metrics.jsonl line (per-layer loads of many experts)
MAX_CONFIG_BYTES = 2**20  # a run's config.yaml

BASE_CONFIG = {
    "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
              "ffn_hidden_size": 256, "seq_length": 64, "first_k_dense": 1},
    # 1024 tokenizer pieces: the output layer would otherwise dominate the step on 2 cores.
    # Sigmoid scores: the gating of the loss-free paper and of DeepSeek-V3; the variants built on
    # a softmax distribution (top-p, Sinkhorn, Skywork) set it themselves.
    "moe": {"num_experts": 8, "ffn_hidden_size": 64, "topk": 2,
            "router": {"score_function": "sigmoid"},
            "balancing": {"methods": "aux_loss", "aux_loss_coeff": 1.0e-2}},
    "data": {"split": "95,5,0", "vocab_size": 1024},
    # 600 steps of 8,192 tokens: the model leaves its early unigram phase (all tokens share one
    # hidden state, so every router sends them to the same experts) around step 100, and a bias
    # moving u = 1e-3 per step needs a few hundred steps more to undo what that phase left.
    "training": {"train_steps": 600, "micro_batch_size": 64, "global_batch_size": 128,
                 "seed": 1234},
    "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 30, "decay_style": "cosine"},
    "checkpoint": {"interval": 0},
    "logging": {"interval": 50, "tensorboard": False, "progress_bar": False},
    "evaluation": {"interval": 50, "batches": 8},
}
QUICK = ["training.train_steps=3",  # `train` expects 3: keep them in step
         "data.vocab_size=4096",  # the default corpus other tests build anyway
         "training.micro_batch_size=4", "training.global_batch_size=8",
         "evaluation.interval=3", "evaluation.batches=1", "optimizer.warmup_steps=1"]
QUICK_BY_ROUTER = {"threshold": ["moe.router.warmup_steps=1"]}
"""--quick's overrides of a router's own settings, for the variants of that router."""

SHARED = ["moe.shared_expert.ffn_hidden_size=64"]
SOFTMAX = "moe.router.score_function=softmax"
CAPACITY = "moe.dispatcher.capacity_factor=1.0"
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "aux_loss": ("top-2, Switch aux loss 1e-2", []),
    "bias": ("top-2, loss-free bias (u 1e-3)", ["moe.balancing.methods=bias"]),
    "top_p": ("dynamic top-p 0.4 (softmax), aux 1e-2 + entropy 1e-4",
              ["moe.router.kind=top_p", SOFTMAX]),
    "top1_shared": ("top-1 + shared expert, aux loss 1e-2", ["moe.topk=1", *SHARED]),
    "threshold": ("expert threshold (1 expert/token target) + shared expert, no aux loss",
                  ["moe.router.kind=threshold", "moe.topk=1", "moe.balancing.methods=none",
                   "moe.router.warmup_steps=20", *SHARED]),
    "sinkhorn": ("Sinkhorn top-2 (softmax), no aux loss",
                 ["moe.router.kind=sinkhorn", SOFTMAX, "moe.balancing.methods=none"]),
    "base": ("BASE layers (balanced top-1), no aux loss",
             ["moe.router.kind=base", "moe.topk=1", "moe.balancing.methods=none"]),
    "aux_capacity": ("top-2 (softmax), aux loss 1e-2, capacity factor 1.0",
                     [SOFTMAX, CAPACITY]),
    "skywork_norm": ("top-2 (softmax), aux loss 1e-2, capacity 1.0, gating-logit norm lambda=1",
                     [SOFTMAX, CAPACITY, "moe.router.gate_logit_norm=1.0"]),
    "skywork_adaptive": ("top-2 (softmax), adaptive aux loss (from 1e-2), capacity 1.0",
                         [SOFTMAX, CAPACITY, "moe.balancing.methods=adaptive_aux_loss"]),
    "erc": ("top-2, aux loss 1e-2 + ERC loss 1e-2", ["moe.balancing.erc_loss_coeff=1.0e-2"]),
    "quantile": ("top-2, quantile balancing (no rate)", ["moe.balancing.methods=quantile"]),
    "quantile_ema": ("top-2, quantile balancing, bias EMA 0.9 (sensitivity)",
                     ["moe.balancing.methods=quantile", "moe.balancing.quantile_ema=0.9"]),
}
SECOND_SEED = "training.seed=4321"
BALANCERS = ("aux_loss", "bias", "quantile", "quantile_ema")
"""The variants the balancing comparison trains again on a second seed (`NAME_seed2`)."""
VARIANTS.update({f"{name}_seed2": (f"{VARIANTS[name][0]}, seed 4321",
                                   [*VARIANTS[name][1], SECOND_SEED]) for name in BALANCERS})


def finished(out: Path, steps: int) -> bool:
    """True when `out` holds a run that logged its last step (an unreadable metrics.jsonl is
    a one-line DataError)."""
    metrics = out / "metrics.jsonl"
    return metrics.is_file() and any(r["step"] == steps for r in read_metrics(out))


def check_outputs(args: argparse.Namespace, steps: int) -> None:
    """Before anything trains: --out and --runs apart, --out replaceable by the study, --runs
    and each variant's run folder in it either the study's (marked), empty, absent or (a
    folder from before marks existed) a finished run, which is only read; one-line
    ConfigError (a DataError for an unreadable finished run) otherwise."""
    check_folder_output(args.out, args.study, "--out")
    if not args.runs:
        return
    try:
        refuse_overlap(args.runs, [args.out], "--runs")
    except ConfigError:
        raise ConfigError(f"--runs {args.runs} and --out {args.out} overlap: the study replaces "
                          "--out when it ends; choose folders apart") from None
    check_folder_output(args.runs, args.study, "--runs")
    for name in args.names:
        run = Path(args.runs) / name
        if finished(run, steps):
            read_config(run)
        else:
            check_folder_output(run, args.study, "--runs")


def study_arguments(study: str, variants: dict, description: str, argv) -> argparse.Namespace:
    """The command line of a variant study (--out, --quick, --jobs, --runs, --variants), with
    `study` and `names`, the variants to train; a bad --variants or --jobs is a ConfigError
    (one line and exit 2 through run_cli)."""
    parser = CliArgumentParser(description=description)
    parser.add_argument("--out", default=str(ROOT / "runs" / study),
                        help=f"result folder (default runs/{study}; the published study: "
                             f"docs/{study})")
    parser.add_argument("--quick", action="store_true", help="a few steps per variant (CI)")
    parser.add_argument("--jobs", type=int_at_least(1), default=1,
                        help="variants trained at a time, one thread each (default 1)")
    parser.add_argument("--runs", help="train (and reuse finished runs) here, kept afterwards")
    parser.add_argument("--variants", default=",".join(variants),
                        help=f"comma-separated subset of {','.join(variants)}")
    args = parser.parse_args(argv)
    args.study = study
    args.names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in args.names if n not in variants]
    if unknown or not args.names:
        raise ConfigError(f"--variants {args.variants!r}: unknown {unknown}; pick from "
                          f"{','.join(variants)}")
    return args


def train_variants(args: argparse.Namespace, variants: dict, base_config: dict,
                   work: Path) -> tuple[dict[str, Path], list[str], int]:
    """Write `base_config` to work/base.yaml and train `args.names` from it, `args.jobs` at a
    time, in --runs (finished runs reused) or work/runs: (the folder of each variant that
    finished, the names that failed, the steps each trains); exits 1 when none finished."""
    base_yaml = work / "base.yaml"
    base_yaml.write_text(yaml.safe_dump(base_config, sort_keys=False))
    runs = claim_folder(args.runs or work / "runs", args.study, "--runs")
    steps = study_steps(args, base_config)

    def train(name: str) -> Path | None:
        overrides = variants[name][1]
        quick = quick_overrides(overrides) if args.quick else []
        return train_run(name, [*overrides, *quick], base_yaml, runs, steps, args.study)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        folders = dict(zip(args.names, pool.map(train, args.names)))
    if all(f is None for f in folders.values()):
        print(f"{args.study}: every variant failed; nothing written", file=sys.stderr)
        raise SystemExit(1)
    return ({n: f for n, f in folders.items() if f is not None},
            [n for n, f in folders.items() if f is None], steps)


def quick_overrides(overrides: list[str]) -> list[str]:
    """--quick's overrides for a variant with `overrides`: QUICK, plus QUICK_BY_ROUTER's for
    the router the variant picks (`moe.router.kind=`, else top-k)."""
    kinds = [o.split("=", 1)[1] for o in overrides if o.startswith("moe.router.kind=")]
    return [*QUICK, *QUICK_BY_ROUTER.get(kinds[-1] if kinds else "topk", [])]


def study_steps(args: argparse.Namespace, base_config: dict) -> int:
    """Steps each variant trains: 3 with --quick, else the base config's."""
    return 3 if args.quick else base_config["training"]["train_steps"]


def study_json(settings: str, base_config: dict, variants: dict, rows: dict, results,
               **extra) -> str:
    """study.json: the settings, base config, each variant's setup, overrides and row, claims."""
    return json.dumps(
        {"settings": settings, **extra, "base_config": base_config,
         "variants": {n: {"setup": variants[n][0], "overrides": variants[n][1], **rows[n]}
                      for n in rows},
         "claims": [{"claim": c, "held": h, "numbers": x} for c, h, x in results]}, indent=1)


def study_folder(out: str) -> tuple[Path, Path]:
    """(the result folder, a new work folder beside it that `publish` later puts in its place)."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))


def train_run(name: str, overrides: list[str], base_yaml: Path, runs: Path,
              steps: int, study: str) -> Path | None:
    """Train `base_yaml` with `overrides` into runs/name, a folder marked as `study`'s,
    through the public entry point (a finished run there is reused; an unfinished one
    replaced only when it is the study's); returns its output folder, or None (and says why)
    when the run failed."""
    out = runs / name
    overrides = [f"output_dir={out}", *overrides]
    if finished(out, steps):
        print(f"[{name}] reusing the finished run in {out}", flush=True)
        return out
    fresh_folder(out, study, "--runs")
    # One intra-op thread: on 2 shared cores a second spinning thread only slows the step.
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "megamoe.train", "--config", str(base_yaml), *overrides]
    print(f"[{name}] {' '.join(overrides[1:]) or '(base config)'}", flush=True)
    started = time.perf_counter()
    done = run_child(command, echo_prefix=f"[{name}] ", cwd=ROOT, env=env)
    if done.returncode != 0:
        print(f"[{name}] FAILED (exit {done.returncode}): {done.stderr.strip()[-2000:]}",
              file=sys.stderr, flush=True)
        return None
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    print(f"[{name}] trained in {time.perf_counter() - started:.0f} s", flush=True)
    return out


def read_metrics(folder: Path) -> list[dict]:
    """Step records of metrics.jsonl, the last one of each step, in step order; read line by
    line within MAX_RECORD_BYTES, a line that is not a metrics record a one-line DataError."""
    path = folder / "metrics.jsonl"
    by_step = {}
    for number, line in bounded_lines(path, MAX_RECORD_BYTES, DataError, str(path)):
        if not line.strip():
            continue
        record = parse_json(line, DataError, f"{path} line {number}")
        if not isinstance(record, dict) or not (type(record.get("step")) is int
                                                or "event" in record):
            raise DataError(f"{path} line {number} is not a metrics record (a JSON object with "
                            "an integer 'step'); is the run a megamoe.train run? Move it out of "
                            "--runs to train it again")
        if "event" not in record:
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def read_config(folder: Path) -> dict:
    """A run's config.yaml (bounded, one-line DataError when it is not a mapping)."""
    path = folder / "config.yaml"
    config = parse_yaml(read_bounded(path, MAX_CONFIG_BYTES, DataError, str(path)), DataError,
                        str(path))
    if not isinstance(config, dict):
        raise DataError(f"{path} is not a training config (a mapping); move the run out of "
                        "--runs to train it again")
    return config


def summarise_runs(all_records: dict[str, list[dict]], folders: dict[str, Path],
                   summarise) -> dict[str, dict]:
    """`summarise(records)` of each run; a run whose records lack what the table needs (a
    metrics.jsonl of another program, say) is a one-line DataError naming its folder."""
    rows = {}
    for name, records in all_records.items():
        try:
            rows[name] = summarise(records)
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as err:
            raise DataError(f"{folders[name]}/metrics.jsonl lacks what the study reads "
                            f"({type(err).__name__}: {str(err)[:80]}); is it a megamoe.train "
                            "run of this study? Move it out of --runs to train it again") from None
    return rows


def layers_of(records: list[dict]) -> list[int]:
    return sorted({int(k.split("/")[1][5:]) for k in records[-1] if k.startswith("moe/layer")})


def series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


def tail_mean(records: list[dict], key: str) -> float:
    values = series(records, key)[-TAIL:]
    return statistics.fmean(values) if values else float("nan")


def pooled_maxvio(records: list[dict], layer: int) -> float:
    """MaxVio of one layer's expert counts summed over the last TAIL steps: the paper's
    MaxVio_global, a load counted over many batches, here the tokens of those steps. Every step
    has the same number of tokens, so step s adds load_s[i] * experts_per_token_s to expert i."""
    tail = [r for r in records if f"moe/layer{layer}/load" in r][-TAIL:]
    weights = [r[f"moe/layer{layer}/experts_per_token"] for r in tail]
    loads = [r[f"moe/layer{layer}/load"] for r in tail]
    counts_E = (torch.tensor(weights, dtype=torch.float64)[:, None]
                * torch.tensor(loads, dtype=torch.float64)).sum(0)
    return float(maxvio(counts_E))


def iid_maxvio(tokens: int, experts: int, topk: int, trials: int = 20) -> float:
    """Mean MaxVio of `tokens` independent tokens that each pick `topk` distinct experts
    uniformly at random: the sampling floor of a perfectly balanced router (real tokens within a
    sequence are correlated, so their floor is higher)."""
    generator = torch.Generator().manual_seed(0)
    values = []
    for _ in range(trials):
        picks = torch.rand(tokens, experts, generator=generator).topk(topk, dim=-1).indices
        values.append(float(maxvio(torch.bincount(picks.flatten(), minlength=experts).float())))
    return statistics.fmean(values)


def sampling_floor(folder: Path) -> str:
    """What MaxVio independent, perfectly balanced top-k tokens would show at the batch of the
    run in `folder`: per step and pooled over TAIL steps."""
    config = read_config(folder)
    try:
        tokens = config["training"]["global_batch_size"] * config["model"]["seq_length"]
        experts, topk = config["moe"]["num_experts"], config["moe"].get("topk", 2)
        if not all(type(v) is int and v > 0 for v in (tokens, experts, topk)) or topk > experts:
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        raise DataError(f"{folder / 'config.yaml'} lacks a positive training.global_batch_size, "
                        "model.seq_length, moe.num_experts and moe.topk <= num_experts; move "
                        "the run out of --runs to train it again") from None
    per_step, pooled = (iid_maxvio(n, experts, topk) for n in (tokens, TAIL * tokens))
    return (f"Sampling floor: {tokens:,} independent tokens per step, each picking {topk} of "
            f"{experts} experts uniformly at random, give MaxVio {per_step:.3f} per step and "
            f"{pooled:.3f} over {TAIL} steps pooled; the tokens of a sequence are correlated, so "
            "a balanced router's own floor is higher.")


def summarise(records: list[dict]) -> dict:
    """The table row of one variant."""
    layers = layers_of(records)
    per_layer = {name: [tail_mean(records, f"moe/layer{n}/{name}") for n in layers]
                 for name in ("maxvio_global", "maxvio_batch", "experts_per_token",
                              "dropped_fraction", "mean_max_gate")}
    pooled = [pooled_maxvio(records, n) for n in layers]
    heldout = series(records, "heldout_loss")
    return {
        "heldout_loss": heldout[-1] if heldout else float("nan"),
        "train_loss": statistics.fmean(series(records, "loss")[-TAIL:]),
        **{name: statistics.fmean(values) for name, values in per_layer.items()},
        "maxvio_pooled": statistics.fmean(pooled),
        "maxvio_pooled_by_layer": pooled,
        "experts_per_token_by_layer": per_layer["experts_per_token"],
        "maxvio_global_by_layer": per_layer["maxvio_global"],
        "step_time_s": statistics.median(series(records, "step_time_s")),
        "layers": layers,
    }


def claims(rows: dict[str, dict]) -> list[tuple[str, object, str]]:
    """(claim, True/False/None when its variants are missing, the numbers behind it)."""
    def have(*names):
        return all(n in rows for n in names)

    out = []
    if have("bias", "aux_loss"):
        b, a = rows["bias"], rows["aux_loss"]
        out.append(("loss-free bias: much lower MaxVio_global than the aux loss (< half) at no "
                    "worse held-out loss (+0.01 at most)",
                    b["maxvio_pooled"] < 0.5 * a["maxvio_pooled"]
                    and b["heldout_loss"] <= a["heldout_loss"] + 0.01,
                    f"MaxVio_global {b['maxvio_pooled']:.3f} vs {a['maxvio_pooled']:.3f}; per "
                    f"step {b['maxvio_global']:.3f} vs {a['maxvio_global']:.3f}; held-out "
                    f"{b['heldout_loss']:.4f} vs {a['heldout_loss']:.4f}"))
        out.append(("bar: loss-free bias MaxVio_global (last 50 steps, mean over layers) <= "
                    "0.05 and held-out loss within 0.01 of the aux-loss run",
                    b["maxvio_pooled"] <= 0.05
                    and abs(b["heldout_loss"] - a["heldout_loss"]) <= 0.01,
                    f"MaxVio_global {b['maxvio_pooled']:.3f} (per step: "
                    f"{b['maxvio_global']:.3f}); held-out difference "
                    f"{b['heldout_loss'] - a['heldout_loss']:+.4f}"))
    else:
        out.append(("loss-free bias vs aux loss", None, "variants bias/aux_loss not run"))
    if have("top_p", "aux_loss"):
        p, a = rows["top_p"], rows["aux_loss"]
        by_layer = p["experts_per_token_by_layer"]
        out.append(("dynamic top-p: < 2 experts per token at held-out loss no worse than top-2 "
                    "by more than 1%",
                    p["experts_per_token"] < 2 and p["heldout_loss"] <= 1.01 * a["heldout_loss"],
                    f"{p['experts_per_token']:.2f} experts/token; held-out "
                    f"{p['heldout_loss']:.4f} vs {a['heldout_loss']:.4f}"))
        out.append(("dynamic top-p: more experts in lower layers (first MoE layer > last)",
                    by_layer[0] > by_layer[-1],
                    "experts/token by layer " + ", ".join(f"{v:.2f}" for v in by_layer)))
    else:
        out.append(("dynamic top-p vs top-2", None, "variants top_p/aux_loss not run"))
    if have("threshold", "top1_shared"):
        t, k = rows["threshold"], rows["top1_shared"]
        out.append(("expert threshold: balances without an aux loss (MaxVio per step no higher "
                    "than top-1 with the aux loss)", t["maxvio_global"] <= k["maxvio_global"],
                    f"MaxVio {t['maxvio_global']:.3f} vs {k['maxvio_global']:.3f}"))
        out.append(("expert threshold: lower held-out loss than token-choice top-1 at equal "
                    "average experts per token (within 0.15)",
                    t["heldout_loss"] < k["heldout_loss"]
                    and abs(t["experts_per_token"] - k["experts_per_token"]) <= 0.15,
                    f"held-out {t['heldout_loss']:.4f} vs {k['heldout_loss']:.4f} at "
                    f"{t['experts_per_token']:.2f} vs {k['experts_per_token']:.2f} "
                    "experts/token"))
    else:
        out.append(("expert threshold vs top-1", None, "variants threshold/top1_shared not run"))
    for name in ("sinkhorn", "base"):
        if have(name):
            r = rows[name]
            out.append((f"{name}: near-perfect balance (MaxVio per step <= 0.1)",
                        r["maxvio_global"] <= 0.1, f"MaxVio {r['maxvio_global']:.3f}"))
    if have("skywork_norm", "aux_capacity"):
        s, a = rows["skywork_norm"], rows["aux_capacity"]
        out.append(("Skywork normalisation sharpens the gates (higher mean max gate)",
                    s["mean_max_gate"] > a["mean_max_gate"],
                    f"mean max gate {s['mean_max_gate']:.3f} vs {a['mean_max_gate']:.3f}"))
    if have("skywork_adaptive", "aux_capacity"):
        s, a = rows["skywork_adaptive"], rows["aux_capacity"]
        out.append(("Skywork adaptive coefficient lowers the drop rate",
                    s["dropped_fraction"] < a["dropped_fraction"],
                    f"dropped {100 * s['dropped_fraction']:.2f}% vs "
                    f"{100 * a['dropped_fraction']:.2f}%"))
    out += quantile_claims(rows)
    return out


def quantile_claims(rows: dict[str, dict]) -> list[tuple[str, object, str]]:
    """Quantile balancing against the loss-free bias, seed by seed."""
    seeds = [suffix for suffix in ("", "_seed2")
             if all(f"{name}{suffix}" in rows for name in ("bias", "quantile"))]
    if not seeds:
        return [("quantile balancing vs loss-free bias", None, "variants bias/quantile not run")]
    out = []
    for suffix in seeds:
        seed = "seed 4321" if suffix else "seed 1234"
        b = rows[f"bias{suffix}"]
        for name, what in (("quantile", "quantile balancing"),
                           ("quantile_ema", "sensitivity, quantile balancing with EMA 0.9")):
            if f"{name}{suffix}" not in rows:
                continue
            q = rows[f"{name}{suffix}"]
            out.append((f"{what} ({seed}): MaxVio_global (pooled and per step) no higher than "
                        "the loss-free bias's, at held-out loss within 0.01 of it",
                        q["maxvio_pooled"] <= b["maxvio_pooled"]
                        and q["maxvio_global"] <= b["maxvio_global"]
                        and abs(q["heldout_loss"] - b["heldout_loss"]) <= 0.01,
                        f"MaxVio_global {q['maxvio_pooled']:.3f} vs {b['maxvio_pooled']:.3f}; "
                        f"per step {q['maxvio_global']:.3f} vs {b['maxvio_global']:.3f}; "
                        f"held-out {q['heldout_loss']:.4f} vs {b['heldout_loss']:.4f}"))
    return out


def verdict(held) -> str:
    return {True: "HELD", False: "DID NOT HOLD", None: "NOT RUN"}[held]


def markdown(rows: dict[str, dict], results, settings: str, floor: str) -> str:
    lines = ["# Routing study", "", settings, "",
             "| variant | setup | held-out loss | train loss | MaxVio_global | MaxVio per step | "
             "MaxVio micro-batch | experts/token (by layer) | dropped | mean max gate | "
             "step time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        by_layer = " / ".join(f"{v:.2f}" for v in r["experts_per_token_by_layer"])
        lines.append(
            f"| {name} | {VARIANTS[name][0]} | {r['heldout_loss']:.4f} | {r['train_loss']:.4f} | "
            f"{r['maxvio_pooled']:.3f} | {r['maxvio_global']:.3f} | {r['maxvio_batch']:.3f} | "
            f"{r['experts_per_token']:.2f} ({by_layer}) | {100 * r['dropped_fraction']:.2f}% | "
            f"{r['mean_max_gate']:.3f} | {r['step_time_s']:.3f} |")
    lines += ["", f"MaxVio_global: MaxVio of the expert loads summed over the last {TAIL} steps "
              "(the paper's global load, counted over many batches). MaxVio per step: over each "
              "step's global batch; MaxVio micro-batch: over each micro-batch. Those two, train "
              f"loss, experts/token, dropped and mean max gate: mean of the last {TAIL} steps. "
              "Every MoE metric is averaged over the MoE layers. Held-out loss at the last step, "
              "in eval mode (each router's inference routing); step time: median.",
              "", floor, "",
              "## Claims", ""]
    lines += [f"- **{verdict(held)}**: {claim} ({numbers})" for claim, held, numbers in results]
    lines += ["", "![MaxVio global](maxvio_global.png)", "", "![held-out loss](heldout_loss.png)",
              "", "Also: [MaxVio per micro-batch](maxvio_batch.png), "
              "[experts per token](experts_per_token.png), [dropped](dropped_fraction.png), "
              "[step time](step_time_s.png).", ""]
    return "\n".join(lines)


def plot(all_records: dict[str, list[dict]], out: Path) -> None:
    """One small PNG per metric: a line per variant (per-layer metrics: one panel per layer)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=60)
        plt.close(fig)

    for key, title in [("heldout_loss", "held-out loss"), ("step_time_s", "step time (s)")]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, records in all_records.items():
            steps = [r["step"] for r in records if key in r]
            ax.plot(steps, series(records, key), label=name, lw=1)
        ax.set_xlabel("step"), ax.set_title(title), ax.legend(fontsize=6, ncol=2)
        save(fig, key)
    layers = layers_of(next(iter(all_records.values())))
    for key, title in [("maxvio_global", "MaxVio (global batch)"),
                       ("maxvio_batch", "MaxVio (micro-batch)"),
                       ("experts_per_token", "experts per token"),
                       ("dropped_fraction", "dropped fraction")]:
        fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3), sharey=True,
                                 squeeze=False)
        for ax, layer in zip(axes[0], layers):
            for name, records in all_records.items():
                full = f"moe/layer{layer}/{key}"
                steps = [r["step"] for r in records if full in r]
                ax.plot(steps, series(records, full), label=name, lw=0.8)
            ax.set_title(f"{title}, layer {layer}", fontsize=8), ax.set_xlabel("step")
            if key.startswith("maxvio"):
                ax.set_yscale("log")
                ax.axhline(0.05, color="k", ls=":", lw=0.8)
        axes[0][-1].legend(fontsize=5, ncol=2)
        save(fig, key)


def publish(work: Path, out: Path, study: str) -> None:
    """Put the finished study folder `work` (its runs removed) in place of `out`, which must
    be empty or the study's own (megamoe.ownership.replace_folder)."""
    shutil.rmtree(work / "runs", ignore_errors=True)
    work.chmod(0o755)
    replace_folder(work, out, study, "--out")


def failed_note(failed: list[str]) -> str:
    """The settings' sentence naming the variants that failed (empty when none did)."""
    return f" FAILED variants (not in the table): {', '.join(failed)}." if failed else ""


def run_study(args: argparse.Namespace, variants: dict, base_config: dict, report,
              verdict) -> int:
    """Train a variant study's `args.names` in a work folder beside `args.out`, have
    `report(work, folders, failed, steps, seconds)` write its study.md, study.json and plots
    there and return its claims, publish the folder as `args.out` and print each claim with
    `verdict(held)`; exit status 1 when a variant failed."""
    check_outputs(args, study_steps(args, base_config))
    out, work = study_folder(args.out)
    end_children_on_sigterm()
    try:
        started = time.perf_counter()
        folders, failed, steps = train_variants(args, variants, base_config, work)
        results = report(work, folders, failed, steps, time.perf_counter() - started)
        publish(work, out, args.study)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for claim, held, numbers in results:
        print(f"{verdict(held)}: {claim} ({numbers})")
    print(f"study written to {out}/study.md")
    return 1 if failed else 0


def report(args: argparse.Namespace, work: Path, folders: dict[str, Path], failed: list[str],
           steps: int, seconds: float) -> list:
    """The routing study's study.md, study.json and plots in `work`; its claims."""
    all_records = {n: read_metrics(folder) for n, folder in folders.items()}
    rows = summarise_runs(all_records, folders, summarise)
    results = claims(rows)
    training_s = sum(sum(series(records, "step_time_s")) for records in all_records.values())
    settings = (f"{'QUICK (pipeline check only) ' if args.quick else ''}{len(args.names)} "
                f"variants x {steps} steps, {training_s:.0f} s of training steps in all "
                f"(this invocation {seconds:.0f} s, {args.jobs} at a time, finished runs "
                "reused); base config `base.yaml` (same seed and data order for every "
                "variant), per-variant overrides in `study.json`." + failed_note(failed))
    floor = sampling_floor(next(iter(folders.values())))
    (work / "study.md").write_text(markdown(rows, results, settings, floor))
    (work / "study.json").write_text(study_json(settings, BASE_CONFIG, VARIANTS, rows, results,
                                                sampling_floor=floor))
    plot(all_records, work)
    return results


def main(argv=None) -> int:
    args = study_arguments("study_routing", VARIANTS, __doc__.split("\n")[0], argv)
    return run_study(args, VARIANTS, BASE_CONFIG, partial(report, args), verdict)


if __name__ == "__main__":
    run_cli(main)
