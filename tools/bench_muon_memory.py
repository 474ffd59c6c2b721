"""Optimizer state per rank of a Muon run, distributed (`optimizer.muon.distributed`, the
default) against replicated, with AdamW's distributed optimizer beside them.

    python tools/bench_muon_memory.py [--config configs/tiny_cpu.yaml] [--ranks 2]
                                      [--expert 1] [SETTING=VALUE ...]

Trains the config at `--ranks` CPU processes (gloo; `parallel.expert` set to `--expert`, so by
default every parameter is data-parallel) for two steps per variant, in one set of processes,
and prints the bytes of optimizer state each rank holds afterwards (`megamoe.plan.measure`: the
distinct storages of the optimizer's tensors besides the parameters and gradients: Muon's
momentum, Adam's moments; fp32 on the CPU, so no main weights), beside what the memory
planner predicts for data-parallel rank 0 on the CPU (fp32) and on GPUs in bf16 (with the fp32
main weights). The last line is the busiest rank's distributed state over the replicated one,
to set beside 1/DP. SETTING=VALUE overrides go to every variant.
"""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")  # megatron-core warns on import that TE and Apex are absent
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from megamoe.errors import CliArgumentParser, int_at_least, run_cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"adamw (distributed optimizer)": ["optimizer.name=adamw"],
            "muon replicated": ["optimizer.name=muon", "optimizer.muon.distributed=false"],
            "muon distributed": ["optimizer.name=muon", "optimizer.muon.distributed=true"]}
MIB = 2 ** 20


def _planned(config, ranks: int, device: str) -> float:
    """The planner's optimizer bytes for data-parallel rank 0 of the first stage."""
    from megamoe.plan.run import plan_config
    from megamoe.plan.state import OPTIMIZER

    return plan_config(config, None, ranks, 1.0, device)[0].stages[0].bytes[OPTIMIZER]


def main(argv=None) -> int:
    parser = CliArgumentParser(description=__doc__.split("\n\n")[0], prog="bench_muon_memory.py")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny_cpu.yaml")
    parser.add_argument("--ranks", type=int_at_least(1), default=2,
                        help="CPU processes, one per rank (default 2)")
    parser.add_argument("--expert", type=int_at_least(1), default=1,
                        help="parallel.expert (default 1: experts data-parallel too)")
    parser.add_argument("settings", nargs="*", help="SETTING=VALUE overrides for every variant")
    args = parser.parse_args(argv)
    from megamoe.train.config import load_config

    configs = {name: load_config(args.config, [*overrides, f"parallel.expert={args.expert}",
                                               *args.settings])
               for name, overrides in VARIANTS.items()}
    from megamoe.plan.layouts import config_layout

    layout = config_layout(next(iter(configs.values())), args.ranks)  # one line if it can't
    from megamoe.plan.measure import measure
    from megamoe.plan.state import OPTIMIZER

    logging.getLogger("megatron").setLevel(logging.ERROR)
    measured = measure([{"name": name, "config": config.to_dict(), "maxvio": 1.0}
                        for name, config in configs.items()], layout.world)
    print(f"{args.config.name} at {layout.name()}: optimizer state per rank, MiB")
    header = ("variant", *(f"rank {r}" for r in range(layout.world)), "planned cpu",
              "planned gpu bf16")
    rows = [header]
    for name, config in configs.items():
        rows.append((name, *(f"{rank[OPTIMIZER] / MIB:.3f}" for rank in measured[name]),
                     f"{_planned(config, args.ranks, 'cpu') / MIB:.3f}",
                     f"{_planned(config, args.ranks, 'cuda') / MIB:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    busiest = {name: max(rank[OPTIMIZER] for rank in measured[name]) for name in configs}
    ratio = busiest["muon distributed"] / busiest["muon replicated"]
    print(f"muon distributed / replicated, busiest rank: {ratio:.3f} (1/DP = "
          f"{1 / layout.data:.3f})")
    return 0


if __name__ == "__main__":
    run_cli(main)
