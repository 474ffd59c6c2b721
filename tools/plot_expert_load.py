"""Plot a training run's MoE metrics as PNG files.

    python tools/plot_expert_load.py runs/tiny_cpu [--out runs/tiny_cpu/plots]

Reads RUN/metrics.jsonl (or a metrics.jsonl path) written by `python -m megamoe.train` and writes:
- expert_load.png: per MoE layer, a heat map of each expert's share of the routed tokens over
  the steps (an even share is 1/E of the tokens);
- maxvio.png: MaxVio per layer over the steps ((max load - mean load) / mean load over the whole
  step's batch, Wang et al., arXiv 2408.15664);
- experts_per_token.png: mean experts chosen per token per layer (varies with top-p routing);
- loss.png: the training loss.
A step logged twice (a run resumed after a crash) counts once, with its last record. OUT is
marked as the tool's (megamoe.ownership): a folder of anyone else's, or one around the metrics
file, is refused in one line.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megamoe.bounded import bounded_lines, parse_json  # noqa: E402
from megamoe.errors import CliArgumentParser, DataError, run_cli  # noqa: E402
from megamoe.ownership import check_folder_output, claim_folder  # noqa: E402

_LAYER = re.compile(r"moe/layer(\d+)/(\w+)$")
TOOL = "plot_expert_load"
MAX_RECORD_BYTES = 16 * 2**20  # one metrics line (per-layer loads of many experts)


def metrics_file(path: Path) -> Path:
    """RUN/metrics.jsonl for a run folder, else `path` itself."""
    return path / "metrics.jsonl" if path.is_dir() else path


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file, one per step (the last of duplicates), by step."""
    path = metrics_file(path)
    if not path.is_file():
        raise DataError(f"no metrics file at {path}; pass a run's output_dir or its metrics.jsonl")
    by_step = {}
    for number, line in bounded_lines(path, MAX_RECORD_BYTES, DataError, str(path)):
        if not line.strip():
            continue
        try:
            record = parse_json(line, DataError, f"{path} line {number}")
            if "event" not in record:  # event lines (a guard tripped) carry no metrics
                by_step[int(record["step"])] = record
        except (DataError, ValueError, KeyError, TypeError):
            raise DataError(f"{path} line {number} is not a metrics record (JSON with a "
                            "'step'); is this a megamoe.train metrics file?") from None
    if not by_step:
        raise DataError(f"{path} holds no metrics records yet")
    return [by_step[step] for step in sorted(by_step)]


def layer_series(records: list[dict], name: str) -> dict[int, tuple[list[int], list]]:
    """{layer: (steps, values)} of per-layer metric `name` over the records that have it."""
    series: dict[int, tuple[list[int], list]] = {}
    for record in records:
        for key, value in record.items():
            match = _LAYER.match(key)
            if match and match.group(2) == name:
                steps, values = series.setdefault(int(match.group(1)), ([], []))
                steps.append(record["step"])
                values.append(value)
    return dict(sorted(series.items()))


def _by_layer(series: dict) -> dict:
    return {f"layer {layer}": values for layer, values in series.items()}


def _plot_lines(plt, series: dict, title: str, ylabel: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (steps, values) in series.items():
        ax.plot(steps, values, label=label, linewidth=1.2)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8, ncol=max(1, len(series) // 8))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_load(plt, series: dict, path: Path) -> None:
    layers = list(series)
    fig, axes = plt.subplots(len(layers), 1, figsize=(9, 1.2 + 2.0 * len(layers)), squeeze=False)
    for ax, layer in zip(axes[:, 0], layers):
        steps, loads = series[layer]
        num_experts = max(len(load) for load in loads)
        grid = [[load[e] * num_experts if e < len(load) else float("nan") for load in loads]
                for e in range(num_experts)]
        image = ax.imshow(grid, aspect="auto", origin="lower", cmap="magma", vmin=0,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, num_experts - 0.5),
                          interpolation="nearest")
        ax.set(title=f"layer {layer}: expert load / even share", xlabel="step", ylabel="expert")
        fig.colorbar(image, ax=ax, pad=0.01)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_run(metrics: Path, out: Path) -> list[Path]:
    """Write the run's PNG plots into `out`; returns their paths."""
    records = read_metrics(metrics)
    loads = layer_series(records, "load")
    if not loads:
        raise DataError(f"{metrics} has no per-layer expert loads (moe/layer*/load); was it "
                        "written by python -m megamoe.train with MoE layers?")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = claim_folder(out, TOOL, "--out", inputs=[metrics_file(metrics)])
    written = [out / "expert_load.png", out / "maxvio.png", out / "experts_per_token.png",
               out / "loss.png"]
    _plot_load(plt, loads, written[0])
    _plot_lines(plt, _by_layer(layer_series(records, "maxvio_global")), "MaxVio per layer",
                "MaxVio (global batch)", written[1])
    _plot_lines(plt, _by_layer(layer_series(records, "experts_per_token")), "Experts per token",
                "mean experts per token", written[2])
    steps = [r["step"] for r in records if "loss" in r]
    _plot_lines(plt, {"training loss": (steps, [r["loss"] for r in records if "loss" in r])},
                "Training loss", "loss", written[3])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = CliArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run's output_dir or its metrics.jsonl")
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: RUN/plots)")
    args = parser.parse_args(argv)
    run_dir = args.run if args.run.is_dir() else args.run.parent
    out = args.out or run_dir / "plots"
    check_folder_output(out, TOOL, "--out", inputs=[metrics_file(args.run)])
    for path in plot_run(args.run, out):
        print(path)
    return 0


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
