"""Plan a training run's memory per rank before booking the GPUs: parameters, gradients,
optimizer state, activations at the pipeline schedule's peak and MoE dispatch buffers at a
routing imbalance, for the config's layout or every layout of a world size.

    python tools/plan_memory.py --config configs/deepseek_v3.yaml [key=value ...]
        [--ranks N | --world N] [--device-memory 80GiB] [--maxvio V] [--json OUT] [--png OUT]
        [--measure]

Without --world: the config's own layout on --ranks ranks (default: the fewest it runs on),
one line per pipeline stage. With --world N: every layout of N ranks the trainer accepts,
ranked (those that fit --device-memory first, then by peak memory). --measure trains the
config's layout a few steps on the CPU (one gloo process per rank) and prints the measured
bytes beside the predicted ones. Parameters and optimizer state are counted on a meta-device
build of the real model; every activation term is written down in docs/memory_planner.md.
Bad input is one line on stderr and exit code 2, with no output file left behind; so is an
output that is, holds or lies inside an input, or is a folder, and a size beyond the largest
model megamoe builds (megamoe.train.settings.sizes, checked when the config loads).
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

from megamoe.errors import CliArgumentParser, int_at_least, run_cli  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0], prog="plan_memory.py")
    p.add_argument("--config", required=True, help="a training config, e.g. "
                   "configs/deepseek_v3.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, as the trainer takes them")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--world", type=int, help="plan every layout of this many ranks")
    where.add_argument("--ranks", type=int, help="ranks of the config's own layout (default: "
                       "the fewest it runs on)")
    p.add_argument("--device-memory", help="memory of one device, e.g. 80GiB, 141GB")
    p.add_argument("--maxvio", type=float, default=1.0,
                   help="routing imbalance to plan for: max expert load / mean - 1 "
                        "(default 1.0)")
    p.add_argument("--json", type=Path, help="write the plan as JSON here")
    p.add_argument("--png", type=Path, help="write per-rank memory by category here (PNG)")
    p.add_argument("--measure", action="store_true",
                   help="also train the layout a few steps on the CPU and print measured "
                        "bytes per rank and category beside the predicted ones")
    p.add_argument("--top", type=int_at_least(1), default=8,
                   help="layouts shown with --world (default 8)")
    return p


def check_outputs(args: argparse.Namespace, inputs: list) -> None:
    """--json and --png: files apart from each other and from every input (one line, exit 2)."""
    from megamoe.ownership import check_file_output

    for flag, path in (("--json", args.json), ("--png", args.png)):
        if path is not None:
            check_file_output(path, flag, inputs)
    if args.json is not None and args.png is not None:
        check_file_output(args.png, "--png", [args.json])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_outputs(args, [args.config])
    from megamoe.plan.limits import check_request, parse_memory
    from megamoe.train.config import load_config

    # Every argument is checked before the planner imports Megatron-Core.
    memory = parse_memory(args.device_memory) if args.device_memory is not None else None
    check_request(args.world, args.ranks, args.maxvio, args.measure)
    config = load_config(args.config, args.overrides)
    check_outputs(args, [args.config, config.data.tokenizer])
    from megamoe.plan.run import main as plan_main

    logging.getLogger("megatron").setLevel(logging.ERROR)
    return plan_main(config, args.world, args.ranks, memory, args.maxvio, args.json, args.png,
                     args.measure, max(1, args.top))


if __name__ == "__main__":
    run_cli(main)
