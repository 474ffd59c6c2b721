"""The memory planner's parameter counts of released MoE models against their published totals
and active counts.

    python tools/bench_parameter_counts.py [--model NAME ...] [--tolerance 0.02]

Builds each model of `megamoe.plan.published.RELEASES` (a recipe of configs/ with its
release's structural settings) on the meta device, as tools/plan_memory.py counts it, and
prints one line per model: the planner's total and active count of the parts each published
figure counts, the published figure, their difference, and what the figure counts. Exit code
1 when a difference exceeds --tolerance (default 2 %).
"""
from __future__ import annotations

import argparse
import logging
import os
import warnings
from pathlib import Path

# megatron-core warns on import that Transformer Engine and Apex are absent.
warnings.filterwarnings("ignore")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from megamoe.errors import CliArgumentParser, ConfigError, run_cli  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def build_parser() -> argparse.ArgumentParser:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0],
                          prog="bench_parameter_counts.py")
    p.add_argument("--model", action="append", default=[],
                   help="only this released model (repeatable; default: all)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="largest relative difference accepted (default 0.02)")
    return p


def _billions(value: float) -> str:
    return f"{value / 1e9:,.2f}B"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megamoe.plan.published import RELEASES, compare

    names = [r.name for r in RELEASES]
    unknown = [name for name in args.model if name not in names]
    if unknown:
        raise ConfigError(f"--model {unknown[0]!r} is not a released model here; pick from "
                          f"{names}")
    if not 0 < args.tolerance < 1:
        raise ConfigError(f"--tolerance {args.tolerance} must be in (0, 1), e.g. 0.02")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    cols = ["model", "total (planner)", "published", "diff", "active (planner)", "published",
            "diff", "active counts besides the layers"]
    rows, worst = [], 0.0
    for release in RELEASES:
        if args.model and release.name not in args.model:
            continue
        c = compare(release, CONFIGS)
        worst = max(worst, abs(c.total_error), abs(c.active_error))
        rows.append([release.name, _billions(c.total), _billions(release.total),
                     f"{c.total_error:+.2%}", _billions(c.active), _billions(release.active),
                     f"{c.active_error:+.2%}", release.active_counts])
    widths = [max(len(col), *(len(row[i]) for row in rows)) for i, col in enumerate(cols)]
    for row in [cols, *rows]:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))
    print(f"largest difference {worst:.2%} (tolerance {args.tolerance:.0%})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    run_cli(main)
