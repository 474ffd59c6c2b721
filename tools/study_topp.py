"""Dynamic top-p study: does top-p routing use fewer experts where it can and more where it must?

    python tools/study_topp.py [--out runs/study_topp] [--quick] [--jobs N] [--runs DIR]
                               [--variants a,b,...]

Results go to runs/ unless `--out` says otherwise; the published study is
`--out docs/study_topp`, so a `--quick` check never overwrites it.

"Harder Tasks Need More Experts: Dynamic Routing in MoE Models" (Huang et al., ACL 2024,
arXiv 2403.07652) claims that dynamic top-p routing (p = 0.4, aux loss 1e-2, dynamic entropy
loss 1e-4) beats top-2 with fewer than 2 experts per token (about 1.76 at inference after some
60B tokens), gives harder inputs more experts, and uses more experts in lower layers. A fair test
at CPU scale, every variant from the same seed and data order:
- MoE in every layer, the lowest included (the authors' code starts its MoE layers at layer 0;
  a dense first layer would remove the layer the "lower layers" claim is about), 16 experts;
- the baselines use the same softmax router, aux loss and no token dropping: top-2 (the paper's
  baseline) and top-1 (with top-2, the line of held-out loss against experts per token that
  fixed top-k routing draws);
- a sweep of p, each run scored by held-out loss against its experts per token at inference
  (eval mode, `heldout/layer{n}/experts_per_token`, logged by the trainer);
- experts per token over training (training and eval mode): is it falling, and where does it
  level off;
- per token, held-out loss against the number of experts (`heldout/layer{n}/loss_by_experts`
  and `.../loss_experts_corr` of the last evaluation).
Every run goes through the public entry point (`python -m megamoe.train`), `--jobs` of them at a
time with one intra-op thread each; OUT holds study.md, study.json, base.yaml and the PNGs,
written atomically. `--quick` (CI) trains a few steps: it checks the pipeline, not the claims.
"""
from __future__ import annotations

import copy
import statistics
from functools import partial
from pathlib import Path

from megamoe.errors import run_cli
from study_routing import BASE_CONFIG as ROUTING_BASE
from study_routing import (failed_note, layers_of, read_metrics, run_study, series,
                           study_arguments, study_json, summarise_runs)

TAIL = 50  # steps averaged for "at the end of training"
PAPER_P = 0.4  # the paper's and its code's threshold

BASE_CONFIG = copy.deepcopy(ROUTING_BASE)
BASE_CONFIG["model"]["first_k_dense"] = 0
BASE_CONFIG["moe"].update({"num_experts": 16, "topk": 2, "router": {"score_function": "softmax"},
                           "balancing": {"methods": "aux_loss", "aux_loss_coeff": 1.0e-2}})
# Twice the routing study's 4.9M tokens; evaluated (eval-mode experts per token too) every 100.
BASE_CONFIG["training"]["train_steps"] = 1200
BASE_CONFIG["evaluation"]["interval"] = 100

TOP_P = ["moe.router.kind=top_p", "moe.router.entropy_loss_coeff=1.0e-4"]  # the paper's weight
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "top2": ("softmax top-2, aux 1e-2, dropless (the paper's baseline)", []),
    "top1": ("softmax top-1, aux 1e-2, dropless", ["moe.topk=1"]),
    **{f"top_p{p}": (f"dynamic top-p {p}, aux 1e-2 + entropy 1e-4, dropless",
                     [*TOP_P, f"moe.router.threshold={p}"]) for p in (0.3, 0.4, 0.5)},
}


def verdict(held) -> str:
    return {True: "HELD", False: "DID NOT HOLD", None: "NOT TESTABLE HERE"}[held]


def paper_variant() -> str:
    return f"top_p{PAPER_P}"


def heldout_series(records: list[dict], key: str) -> tuple[list[int], list]:
    """(steps, values) of an evaluation metric (logged every `evaluation.interval` steps)."""
    kept = [r for r in records if key in r]
    return [r["step"] for r in kept], [r[key] for r in kept]


def window_mean(records: list[dict], layers: list[int], first: int, last: int) -> float:
    """Training-mode experts per token, mean over layers and the steps first..last."""
    values = [statistics.fmean(r[f"moe/layer{n}/experts_per_token"] for n in layers)
              for r in records if first <= r["step"] <= last]
    return statistics.fmean(values) if values else float("nan")


def summarise(records: list[dict]) -> dict:
    """The table row of one variant: the last evaluation and the course of training."""
    layers = layers_of(records)
    final = [r for r in records if "heldout_loss" in r][-1]
    steps = records[-1]["step"]
    tail = max(1, min(TAIL, steps // 4))
    eval_by_layer = [final[f"heldout/layer{n}/experts_per_token"] for n in layers]
    corr = [final.get(f"heldout/layer{n}/loss_experts_corr") for n in layers]
    return {
        "layers": layers,
        "heldout_loss": final["heldout_loss"],
        "experts_per_token": statistics.fmean(eval_by_layer),
        "experts_per_token_by_layer": eval_by_layer,
        # training mode: the start, and the last two windows (levelling off: their difference)
        "train_experts_start": window_mean(records, layers, 1, tail),
        "train_experts_before": window_mean(records, layers, steps - 4 * tail + 1,
                                            steps - 3 * tail),
        "train_experts_end": window_mean(records, layers, steps - tail + 1, steps),
        "loss_experts_corr_by_layer": corr,
        "loss_by_experts_by_layer": [final.get(f"heldout/layer{n}/loss_by_experts")
                                     for n in layers],
        "tokens_by_experts_by_layer": [final.get(f"heldout/layer{n}/tokens_by_experts")
                                       for n in layers],
        "step_time_s": statistics.median(series(records, "step_time_s")),
        "tail": tail,
    }


def topk_line(rows: dict[str, dict], experts: float) -> float | None:
    """Held-out loss of the line through top-1 and top-2 at `experts` per token (None outside
    [1, 2] or without both baselines)."""
    if not ("top1" in rows and "top2" in rows) or not 1.0 <= experts <= 2.0:
        return None
    one, two = rows["top1"]["heldout_loss"], rows["top2"]["heldout_loss"]
    return one + (two - one) * (experts - 1.0)


def claims(rows: dict[str, dict]) -> list[tuple[str, object, str]]:
    """(claim, True/False/None when it cannot be tested, the numbers behind it)."""
    out = []
    paper = rows.get(paper_variant())
    top2 = rows.get("top2")
    if paper is not None and top2 is not None:
        out.append((f"top-p {PAPER_P}: fewer than 2 experts per token at inference at a held-out "
                    "loss no worse than top-2 by more than 1%",
                    paper["experts_per_token"] < 2
                    and paper["heldout_loss"] <= 1.01 * top2["heldout_loss"],
                    f"{paper['experts_per_token']:.2f} experts/token; held-out "
                    f"{paper['heldout_loss']:.4f} vs {top2['heldout_loss']:.4f}"))
    if paper is not None:
        out.append((f"top-p {PAPER_P}: experts per token fall during training",
                    paper["train_experts_end"] < paper["train_experts_start"],
                    f"training mode {paper['train_experts_start']:.2f} in the first "
                    f"{paper['tail']} steps, {paper['train_experts_end']:.2f} in the last "
                    f"{paper['tail']}"))
        by_layer = paper["experts_per_token_by_layer"]
        out.append((f"top-p {PAPER_P}: more experts in lower layers (lowest MoE layer > "
                    "highest, at inference)", by_layer[0] > by_layer[-1],
                    "experts/token by layer " + ", ".join(f"{v:.2f}" for v in by_layer)))
        corr = paper["loss_experts_corr_by_layer"]
        known = [c for c in corr if c is not None]
        out.append((f"top-p {PAPER_P}: harder tokens get more experts (a token's held-out loss "
                    "correlates positively with its number of experts, in every MoE layer)",
                    all(c > 0 for c in known) if len(known) == len(corr) else None,
                    "correlation by layer " + ", ".join(
                        "n/a" if c is None else f"{c:+.3f}" for c in corr)))
    for name, row in rows.items():
        if not name.startswith("top_p"):
            continue
        line = topk_line(rows, row["experts_per_token"])
        out.append((f"{name}: lower held-out loss than fixed top-k at the same experts per token "
                    "(the top-1/top-2 line)",
                    None if line is None else row["heldout_loss"] < line,
                    f"held-out {row['heldout_loss']:.4f} at {row['experts_per_token']:.2f} "
                    "experts/token; top-k line there "
                    + ("n/a (outside 1..2 experts or a baseline missing)" if line is None
                       else f"{line:.4f}")))
    return out


def markdown(rows: dict[str, dict], results, settings: str) -> str:
    lines = ["# Dynamic top-p study", "", settings, "",
             "| variant | setup | held-out loss | experts/token at inference (by layer) | "
             "experts/token in training: start -> end (before) | loss-experts correlation "
             "(by layer) | step time (s) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        by_layer = " / ".join(f"{v:.2f}" for v in r["experts_per_token_by_layer"])
        corr = " / ".join("n/a" if c is None else f"{c:+.2f}"
                          for c in r["loss_experts_corr_by_layer"])
        lines.append(
            f"| {name} | {VARIANTS[name][0]} | {r['heldout_loss']:.4f} | "
            f"{r['experts_per_token']:.2f} ({by_layer}) | {r['train_experts_start']:.2f} -> "
            f"{r['train_experts_end']:.2f} ({r['train_experts_before']:.2f}) | {corr} | "
            f"{r['step_time_s']:.3f} |")
    tail = next(iter(rows.values()))["tail"]
    lines += ["", "Held-out loss and experts per token at inference: the last evaluation (eval "
              "mode, mean over MoE layers). Experts per token in training: mean of the first "
              f"{tail} steps -> the last {tail} steps (in brackets the {tail} steps ending "
              f"{3 * tail} steps before the end: close to the last window where it has levelled "
              "off). Correlation: Pearson, over the held-out tokens, between a token's loss and "
              "its number of experts in that layer; step time: median.", "",
              "## Claims", ""]
    lines += [f"- **{verdict(held)}**: {claim} ({numbers})" for claim, held, numbers in results]
    lines += ["", "![held-out loss against experts per token](frontier.png)", "",
              "![experts per token over training](experts_per_token.png)", "",
              "![held-out loss by number of experts](loss_by_experts.png)", "",
              "Also: [held-out loss over training](heldout_loss.png).", ""]
    return "\n".join(lines)


def plot(all_records: dict[str, list[dict]], rows: dict[str, dict], out: Path) -> None:
    """frontier.png (held-out loss against experts per token), experts_per_token.png (per
    layer, training and eval mode), loss_by_experts.png (the paper's p), heldout_loss.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=60)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    fixed = [n for n in ("top1", "top2") if n in rows]
    ax.plot([rows[n]["experts_per_token"] for n in fixed],
            [rows[n]["heldout_loss"] for n in fixed], "k--o", label="top-k")
    for name, row in rows.items():
        if name.startswith("top_p"):
            ax.plot(row["experts_per_token"], row["heldout_loss"], "s", label=name)
    ax.set_xlabel("experts per token (inference)"), ax.set_ylabel("held-out loss")
    ax.legend(fontsize=7)
    save(fig, "frontier")

    layers = layers_of(next(iter(all_records.values())))
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3), sharey=True,
                             squeeze=False)
    for ax, layer in zip(axes[0], layers):
        for index, (name, records) in enumerate(all_records.items()):
            color = f"C{index}"
            key = f"moe/layer{layer}/experts_per_token"
            ax.plot([r["step"] for r in records if key in r], series(records, key), color=color,
                    lw=0.6, label=f"{name} (train)")
            steps, values = heldout_series(records, f"heldout/layer{layer}/experts_per_token")
            ax.plot(steps, values, "o", color=color, ms=2.5, label=f"{name} (eval)")
        ax.set_title(f"experts per token, layer {layer}", fontsize=8), ax.set_xlabel("step")
    axes[0][-1].legend(fontsize=5, ncol=2)
    save(fig, "experts_per_token")

    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3), sharey=True,
                             squeeze=False)
    paper = rows.get(paper_variant()) or next(iter(rows.values()))
    for ax, layer, losses, share in zip(axes[0], layers, paper["loss_by_experts_by_layer"],
                                        paper["tokens_by_experts_by_layer"]):
        kept = [(k, loss, s) for k, (loss, s) in enumerate(zip(losses or [], share or []))
                if loss is not None and s >= 0.001]
        ax.bar([k for k, _, _ in kept], [loss for _, loss, _ in kept])
        for k, loss, s in kept:
            ax.text(k, loss, f"{100 * s:.0f}%", ha="center", va="bottom", fontsize=6)
        ax.set_title(f"held-out loss by experts, layer {layer}", fontsize=8)
        ax.set_xlabel("experts for the token (share of tokens)")
    save(fig, "loss_by_experts")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, records in all_records.items():
        steps, values = heldout_series(records, "heldout_loss")
        ax.plot(steps, values, label=name, lw=1)
    ax.set_xlabel("step"), ax.set_title("held-out loss"), ax.legend(fontsize=7)
    save(fig, "heldout_loss")


def report(args, work: Path, folders: dict[str, Path], failed: list[str], steps: int,
           seconds: float) -> list:
    """The top-p study's study.md, study.json and plots in `work`; its claims."""
    all_records = {n: read_metrics(folder) for n, folder in folders.items()}
    rows = summarise_runs(all_records, folders, summarise)
    results = claims(rows)
    tokens = BASE_CONFIG["training"]["global_batch_size"] * BASE_CONFIG["model"]["seq_length"]
    settings = (f"{'QUICK (pipeline check only) ' if args.quick else ''}{len(args.names)} "
                f"variants x {steps} steps ({steps * tokens / 1e6:.1f}M tokens each unless "
                f"quick), trained {args.jobs} at a time in {seconds:.0f} s (finished runs "
                "reused); base config `base.yaml` (same seed and data order for every "
                "variant), per-variant overrides in `study.json`. The paper's figures come "
                "after about 60B tokens; this study shows the direction at CPU scale."
                + failed_note(failed))
    (work / "study.md").write_text(markdown(rows, results, settings))
    (work / "study.json").write_text(study_json(settings, BASE_CONFIG, VARIANTS, rows, results))
    plot(all_records, rows, work)
    return results


def main(argv=None) -> int:
    args = study_arguments("study_topp", VARIANTS, __doc__.split("\n")[0], argv)
    return run_study(args, VARIANTS, BASE_CONFIG, partial(report, args), verdict)


if __name__ == "__main__":
    run_cli(main)
