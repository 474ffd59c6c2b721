"""Where a run stands: its step count and data position, and the `latest` checkpoint marker.

Kept free of torch and Megatron imports, so the entry point can tell in a moment whether a
(requeued) run has already finished.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megamoe.errors import CheckpointError

LATEST = "latest"


@dataclass
class TrainState:
    """Optimizer steps taken and samples consumed by all data-parallel ranks together."""

    iteration: int = 0
    consumed_samples: int = 0


def checkpoint_name(iteration: int) -> str:
    """The folder name of the checkpoint after `iteration` steps."""
    return f"iter_{iteration:07d}"


def latest_checkpoint(ckpt_dir: str | Path) -> Optional[Path]:
    """The checkpoint folder `latest` names in `ckpt_dir`, or None when there is none yet."""
    marker = Path(ckpt_dir) / LATEST
    if not marker.is_file():
        return None
    name = marker.read_text().strip()
    path = marker.parent / name
    if not re.fullmatch(r"iter_\d{7}", name) or not path.is_dir():
        raise CheckpointError(f"{marker} names {name!r}, which is not a checkpoint folder in "
                              f"{marker.parent}; restore the folder or delete {marker}")
    return path


def iteration_of(checkpoint: Path) -> int:
    """The step count of a checkpoint folder named by `checkpoint_name`."""
    return int(checkpoint.name.split("_")[1])
