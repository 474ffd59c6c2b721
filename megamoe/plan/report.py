"""The plan for people and scripts: a console table, JSON, and a PNG of per-rank memory by
category."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megamoe.errors import ConfigError
from megamoe.plan.counts import ParameterCounts
from megamoe.plan.plan import CATEGORIES, LayoutPlan

SHORT = {"parameters": "params", "gradients": "grads", "optimizer": "optim",
         "activations": "activ", "moe_dispatch": "moe"}


def gib(value: float) -> str:
    return f"{value / 2**30:,.2f}"


def _ranks(stage) -> str:
    first, last = stage.ranks[0], stage.ranks[-1]
    return f"{first}" if first == last else f"{first}-{last}"


def layout_table(plan: LayoutPlan, device_memory: Optional[float],
                 measured: Optional[list[dict]] = None) -> str:
    """One line per pipeline stage (its ranks hold equal shards), GiB per category; with
    `measured`, one line per rank of predicted / measured bytes."""
    layout = plan.layout
    head = (f"{layout.name()} on {layout.world} ranks, {plan.precision}, "
            f"{plan.num_microbatches} micro-batches per step, MaxVio {plan.maxvio:g}")
    lines = [head]
    if measured is None:
        cols = ["ranks", "stage", "layers", *[SHORT[c] for c in CATEGORIES], "total GiB",
                "in flight", "a2a GiB/step"]
        rows = []
        for s in plan.stages:
            span = f"{s.layers[0]}-{s.layers[-1]}" if s.layers else "-"
            fits = "" if device_memory is None else ("  ok" if s.total <= device_memory
                                                      else "  OUT OF MEMORY")
            rows.append([_ranks(s), str(s.stage), span, *[gib(s.bytes[c]) for c in CATEGORIES],
                         gib(s.total) + fits, str(s.in_flight),
                         gib(s.all_to_all_bytes_per_step)])
        return "\n".join(lines + _columns(cols, rows))
    cols = ["rank", "stage", *[f"{SHORT[c]} pred/meas MiB" for c in CATEGORIES]]
    rows = []
    for rank, result in enumerate(measured):
        s = plan.rank_stage(rank)
        rows.append([str(rank), str(s.stage), *[
            f"{s.bytes[c] / 2**20:.3f} / {result[c] / 2**20:.3f} ({_ratio(s.bytes[c], result[c])})"
            for c in CATEGORIES]])
    return "\n".join(lines + _columns(cols, rows))


def _ratio(predicted: float, measured: float) -> str:
    if measured == 0:
        return "-" if predicted == 0 else "bound"
    return f"{predicted / measured:.2f}x"


def _columns(cols: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*cols)] + [fmt.format(*row) for row in rows]


def ranking_table(plans: list[LayoutPlan], device_memory: Optional[float], top: int) -> str:
    """The layouts of a world size, fitting first, then by peak rank memory."""
    cols = ["#", "layout", "peak GiB", "fits", "micro-batches", "a2a GiB/step (max rank)"]
    rows = []
    for index, plan in enumerate(ranked(plans, device_memory)[:top], 1):
        fits = "-" if device_memory is None else ("yes" if plan.peak <= device_memory else "no")
        rows.append([str(index), plan.layout.name(), gib(plan.peak), fits,
                     str(plan.num_microbatches),
                     gib(max(s.all_to_all_bytes_per_step for s in plan.stages))])
    return "\n".join(_columns(cols, rows))


def ranked(plans: list[LayoutPlan], device_memory: Optional[float]) -> list[LayoutPlan]:
    """Fitting layouts first, each group by peak memory, then by all-to-all volume."""
    def key(plan):
        fits = device_memory is None or plan.peak <= device_memory
        return (not fits, plan.peak, max(s.all_to_all_bytes_per_step for s in plan.stages))
    return sorted(plans, key=key)


def billions(value: int) -> str:
    return f"{value / 1e9:.2f}B"


def counts_text(counts: ParameterCounts, vocab: tuple[int, str]) -> str:
    """The model's parameter counts for people: total (and its multi-token-prediction block),
    and active per token with and without the embedding and output layer, the ways released
    models' figures count them (docs/memory_planner.md)."""
    mtp = (f" ({billions(counts.main)} + {billions(counts.mtp)} in {counts.mtp_depths} "
           f"multi-token-prediction depth(s), {billions(counts.mtp_active)} of it active)"
           if counts.mtp_depths else "")
    return (f"parameters: {counts.total:,} total, {counts.active:,} active per token "
            f"({billions(counts.total)} / {billions(counts.active)}; vocabulary {vocab[0]:,} "
            f"from {vocab[1]}){mtp}\n"
            f"active per token without the input embedding: "
            f"{billions(counts.active_without_embedding)}; without embedding and output layer: "
            f"{billions(counts.active_without_embedding_and_output)}")


def to_json(plans: list[LayoutPlan], counts: ParameterCounts, vocab: tuple[int, str],
            device_memory: Optional[float], measured: Optional[list[dict]] = None) -> dict:
    """The plan as plain data: `total_parameters`, `active_parameters`, `parameters` (every
    count of `ParameterCounts.as_dict`), then `entries`, one per layout, rank and category
    (bytes; `measured_bytes` with --measure), and per layout its ranks' totals."""
    entries, layouts = [], []
    for plan in plans:
        ranks = []
        for rank in range(plan.layout.world):
            s = plan.rank_stage(rank)
            for category in CATEGORIES:
                entry = {"layout": plan.layout.name(), "rank": rank, "stage": s.stage,
                         "category": category, "bytes": int(s.bytes[category])}
                if measured is not None:
                    entry["measured_bytes"] = int(measured[rank][category])
                entries.append(entry)
            ranks.append({"rank": rank, "stage": s.stage, "total_bytes": int(s.total),
                          "fits": device_memory is None or s.total <= device_memory,
                          "in_flight_microbatches": s.in_flight,
                          "all_to_all_bytes_per_step": int(s.all_to_all_bytes_per_step)})
        layouts.append({"layout": plan.layout.name(), **plan.layout.parallel_section(),
                        "world": plan.layout.world, "data": plan.layout.data,
                        "precision": plan.precision, "maxvio": plan.maxvio,
                        "num_microbatches": plan.num_microbatches,
                        "peak_bytes": int(plan.peak),
                        "fits": device_memory is None or plan.peak <= device_memory,
                        "ranks": ranks})
    return {"total_parameters": counts.total, "active_parameters": counts.active,
            "parameters": counts.as_dict(),
            "vocab_size": vocab[0], "vocab_source": vocab[1],
            "device_memory_bytes": device_memory, "categories": list(CATEGORIES),
            "entries": entries, "layouts": layouts}


def write_json(path: Path, data: dict) -> None:
    from megamoe.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def write_png(path: Path, plans: list[LayoutPlan], device_memory: Optional[float],
              top: int) -> None:
    """Stacked bars of each rank's bytes by category (one bar per pipeline stage: its ranks
    are alike), one panel per layout, the ranked first `top` layouts; written through a
    temporary file and a rename."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--png needs matplotlib; install it (pip install -e '.[train]') or "
                          "drop --png") from None
    import os
    import tempfile

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ranked(plans, device_memory)[:top]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.6 * len(shown) + 0.6), squeeze=False)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    for ax, plan in zip(axes[:, 0], shown):
        labels = [f"{_ranks(s)}" for s in plan.stages]
        bottom = [0.0] * len(plan.stages)
        for category, color in zip(CATEGORIES, colors):
            values = [s.bytes[category] / 2**30 for s in plan.stages]
            ax.bar(labels, values, bottom=bottom, color=color, label=category)
            bottom = [b + v for b, v in zip(bottom, values)]
        if device_memory is not None:
            ax.axhline(device_memory / 2**30, color="black", linestyle="--", linewidth=1,
                       label="device memory")
        ax.set_title(f"{plan.layout.name()}: peak {gib(plan.peak)} GiB", fontsize=9)
        ax.set_ylabel("GiB per rank")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("ranks (one bar per pipeline stage)")
    axes[0, 0].legend(fontsize=7, ncol=3, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
