"""What `tools/plan_memory.py` does: read the config, plan its layout (or every layout of a
world size), optionally measure it, print and write the results."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from megamoe.errors import ConfigError
from megamoe.plan.layouts import config_layout, layouts_of_world
from megamoe.plan.limits import check_request
from megamoe.plan.plan import LayoutPlan, plan_layout
from megamoe.plan.counts import parameter_counts
from megamoe.plan.report import (counts_text, layout_table, ranking_table, to_json, write_json,
                                 write_png)
from megamoe.plan.shards import model_vocab_size
from megamoe.train.config import TrainConfig

def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def plan_config(config: TrainConfig, world: Optional[int], ranks: Optional[int],
                maxvio: float, device: str) -> list[LayoutPlan]:
    """The config's layout (on `ranks` ranks), or every layout of `world` ranks."""
    vocab = model_vocab_size(config)[0]
    if world is None:
        layout = config_layout(config, ranks)
        return [plan_layout(config, layout, vocab, maxvio, device)]
    candidates = list(layouts_of_world(config, world))
    if not candidates:
        raise ConfigError(f"--world {world}: no layout of {world} ranks fits this config "
                          "(layers, heads, experts and the global batch must split over it); "
                          "try another world size")
    plans = []
    for index, (layout, at_layout) in enumerate(candidates, 1):
        _note(f"planning {layout.name()} ({index}/{len(candidates)})")
        plans.append(plan_layout(at_layout, layout, vocab, maxvio, device))
    return plans


def measure_config(config: TrainConfig, ranks: Optional[int], maxvio: float) -> list[dict]:
    """`--measure`: the config's layout trained on the CPU; per rank, bytes per category."""
    from megamoe.plan.measure import measure

    layout = config_layout(config, ranks)
    if layout.world > 8:
        raise ConfigError(f"--measure runs one CPU process per rank; {layout.name()} needs "
                          f"{layout.world}: measure a small config (e.g. configs/tiny_cpu.yaml)")
    _note(f"measuring {layout.name()} on {layout.world} CPU process(es)")
    run = {"name": "run", "config": config.to_dict(), "maxvio": maxvio}
    return measure([run], layout.world)["run"]


def main(config: TrainConfig, world: Optional[int], ranks: Optional[int],
         device_memory: Optional[float], maxvio: float, json_path: Optional[Path],
         png_path: Optional[Path], measure: bool, top: int) -> int:
    """Plan, print, write; the exit code (0)."""
    check_request(world, ranks, maxvio, measure)
    vocab = model_vocab_size(config)
    counts = parameter_counts(config, vocab[0])
    print(counts_text(counts, vocab))
    plans = plan_config(config, world, ranks, maxvio, "cpu" if measure else "cuda")
    measured = measure_config(config, ranks, maxvio) if measure else None
    if world is None:
        print(layout_table(plans[0], device_memory))
        if measured is not None:
            print("predicted / measured per rank (moe: the plan is the busiest rank's; "
                  "'bound': measured 0)")
            print(layout_table(plans[0], device_memory, measured))
    else:
        print(ranking_table(plans, device_memory, top))
    if json_path is not None:
        write_json(json_path, to_json(plans, counts, vocab, device_memory, measured))
        print(f"JSON: {json_path}")
    if png_path is not None:
        write_png(png_path, plans, device_memory, top)
        print(f"PNG: {png_path}")
    return 0

