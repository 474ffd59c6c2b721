"""Megatron-LM's checkpoint directory layout, in one module: the tracker file, the `iter_N`
folders, where the weights of one checkpoint lie, and where a run stands (steps, samples).

The checkpoint folder follows Megatron-LM's save-directory convention
(`megatron/training/checkpointing.py`: `get_checkpoint_tracker_filename`, `get_checkpoint_name`,
`read_metadata`): `latest_checkpointed_iteration.txt` holds the iteration of the newest complete
checkpoint, which is the folder `iter_<iteration:07d>`. Folders of older megamoe runs, with a
`latest` file naming the folder, are still read. Kept free of torch and Megatron imports, so the
entry point can tell in a moment whether a (requeued) run has already finished.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megamoe.atomic import atomic_write_text
from megamoe.bounded import read_bytes_bounded
from megamoe.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_LATEST = "latest"
RELEASE = "release"
"""The folder a tracker holding `release` names: Megatron-LM's converted, step-less weights, where
megamoe's converters (upcycle, import) write theirs."""
CONVERTED_MODEL_KEY = "megamoe_model"
"""Common-state key of the model settings (`model`, `moe` sections) a converter (upcycle, HF and
DeepSpeed import) records in the checkpoint it writes."""
_NAME = re.compile(r"iter_(\d{7})")
MAX_MARKER_BYTES = 4096


@dataclass
class TrainState:
    """Optimizer steps taken and samples consumed by all data-parallel ranks together."""

    iteration: int = 0
    consumed_samples: int = 0


def checkpoint_name(iteration: int) -> str:
    """The folder name of the checkpoint after `iteration` steps (Megatron-LM's `iter_%07d`)."""
    return f"iter_{iteration:07d}"


def read_tracker(ckpt_dir: Path, allow_release: bool = False) -> Optional[tuple[Path, str]]:
    """(the marker file, the folder name it designates) in `ckpt_dir`, or None without one:
    Megatron-LM's tracker (an iteration, or `release` when `allow_release`), else an older
    megamoe run's `latest` file."""
    tracker = ckpt_dir / TRACKER
    if tracker.exists():  # a folder or device in its place is refused, not taken for none
        text = _marker_text(tracker)
        if allow_release and text == RELEASE:
            return tracker, RELEASE
        if not text.isdigit() or not text.isascii():
            raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number; "
                                  f"write the iteration of a folder in {ckpt_dir} into it or "
                                  "delete it")
        return tracker, checkpoint_name(int(text))
    legacy = ckpt_dir / LEGACY_LATEST
    if legacy.is_file():
        return legacy, _marker_text(legacy)
    return None


def _marker_text(path: Path) -> str:
    """The stripped text of a tracker file, which holds one short line (at most MAX_MARKER_BYTES:
    a larger file, a folder or a device in its place is refused in one line)."""
    raw = read_bytes_bounded(path, MAX_MARKER_BYTES, CheckpointError, f"tracker file {path}")
    return raw.decode("utf-8", "replace").strip()


def latest_checkpoint(ckpt_dir: str | Path) -> Optional[Path]:
    """The checkpoint folder the tracker names in `ckpt_dir`, or None when there is none yet."""
    ckpt_dir = Path(ckpt_dir)
    tracked = read_tracker(ckpt_dir)
    if tracked is None:
        return None
    marker, name = tracked
    path = ckpt_dir / name
    if not _NAME.fullmatch(name) or not path.is_dir():
        raise CheckpointError(f"{marker} names {name[:40]!r}, which is not a checkpoint folder "
                              f"in {ckpt_dir}; restore the folder, or set "
                              "checkpoint.resume_from_verified=true to resume from the newest "
                              "checkpoint that verifies")
    return path


def resolve_weights_dir(path: str | Path) -> Path:
    """The torch_dist folder of `path`: a Megatron-LM root (`latest_checkpointed_iteration.txt`,
    as tools/upcycle_ckpt.py writes; `release` allowed), a megamoe checkpoint folder, or the
    folder itself."""
    path = Path(path).expanduser()
    tracked = read_tracker(path, allow_release=True)
    if tracked is not None and tracked[1] == RELEASE:
        path = path / RELEASE
    else:
        path = latest_checkpoint(path) or path
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"no torch_dist checkpoint at {path} (metadata.json missing); pass "
                              f"a checkpoint folder or a root with {TRACKER}")
    return path


def saved_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Every `iter_NNNNNNN` folder in `ckpt_dir`, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if _NAME.fullmatch(p.name) and p.is_dir())


def write_tracker(ckpt_dir: str | Path, iteration: int) -> None:
    """Point the tracker at `iter_<iteration>` (atomically); drop an older run's `latest`."""
    ckpt_dir = Path(ckpt_dir)
    atomic_write_text(ckpt_dir / TRACKER, f"{iteration}\n")
    with contextlib.suppress(FileNotFoundError):
        (ckpt_dir / LEGACY_LATEST).unlink()


def iteration_of(checkpoint: Path) -> int:
    """The step count of a checkpoint folder named by `checkpoint_name`."""
    return int(checkpoint.name.split("_")[1])


def step_of(folder: Path) -> Optional[int]:
    """The step of a folder named like a checkpoint (`iter_NNNNNNN`), else None."""
    return iteration_of(folder) if _NAME.fullmatch(folder.name) else None


def tracked_step(ckpt_dir: Path) -> Optional[int]:
    """The step the tracker of `ckpt_dir` names, or None when it names none (no tracker, or
    one that does not hold an iteration)."""
    try:
        tracked = read_tracker(ckpt_dir)
    except CheckpointError:
        return None
    return step_of(Path(tracked[1])) if tracked is not None else None


def check_folder_step(folder: Path, recorded: object, field: str) -> None:
    """Refuse a checkpoint folder `iter_N` whose common state records another step than N
    (`recorded`, read from `field`): a folder renamed, copied over another or edited. Folders
    not named like a checkpoint (an `init_from` folder, `release`) have no step to agree with."""
    step = step_of(folder)
    if step is not None and (type(recorded) is not int or recorded != step):
        raise CheckpointError(f"{folder}: its common state says {field}={recorded!r:.40} but the "
                              f"folder is step {step}; the checkpoint is corrupt (restore it, or "
                              f"write the step of another checkpoint into {TRACKER})")
