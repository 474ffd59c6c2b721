"""The versioned schema of what a megamoe training checkpoint keeps of its run, and how a
checkpoint written by an older megamoe is read.

Format 1 (every megamoe release so far), in the checkpoint's common state:
    format_version  1
    config          the run's TrainConfig as plain data (`TrainConfig.to_dict`)
    train_state     {iteration, consumed_samples}
    layout          the parallel sizes it was saved at
    lr_schedule     the learning-rate schedule

Upgrades: `UPGRADES[v]` turns the common state of format v into format v + 1 (renamed or
removed settings are rewritten there, so nothing else needs to know old formats); a checkpoint
of a newer format than this megamoe's is refused.

Resuming compares the saved `model` and `moe` settings with the config's, each with the
defaults of the current schema filled in, so a setting added after the checkpoint was written
reads as its default: an older checkpoint resumes as long as the config leaves new settings at
their defaults (a new setting's default keeps the behaviour it had before it existed). Only a
setting that differs, which would build a different model, refuses, naming it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from megamoe.config import MoEConfig
from megamoe.errors import CheckpointError
from megamoe.train.config import ModelConfig, TrainConfig

FORMAT_VERSION = 1
UPGRADES: dict[int, Callable[[dict], dict]] = {}
"""format v -> the function that rewrites a format-v common state as format v + 1."""

ARCHITECTURE_SECTIONS = ("model", "moe")
"""The config sections that define the model; the others (parallel sizes, data, schedule,
checkpointing) may change on resume."""


def is_megamoe_state(common: dict) -> bool:
    """Whether a common state was written by megamoe (any format version)."""
    version = common.get("format_version")
    return isinstance(version, int) and not isinstance(version, bool)


def upgraded(common: dict, path: Path) -> dict:
    """`common` rewritten as the current format (unchanged when it already is)."""
    version = common["format_version"]
    if version > FORMAT_VERSION or version < 1:
        raise CheckpointError(f"{path} has checkpoint format {version}; this megamoe reads "
                              f"formats 1..{FORMAT_VERSION}: use the megamoe release that wrote "
                              "it (or a newer one)")
    while version < FORMAT_VERSION:
        common = {**UPGRADES[version](common), "format_version": version + 1}
        version += 1
    return common


def _defaults(kind: type) -> dict[str, Any]:
    values = {}
    for field in dataclasses.fields(kind):
        if field.default is not dataclasses.MISSING:
            values[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            values[field.name] = field.default_factory()
    return values


def section_defaults(section: str) -> dict[str, Any]:
    """The value each setting of an architecture section takes when it is not written."""
    if section == "model":
        return _defaults(ModelConfig)
    defaults = _defaults(MoEConfig)
    defaults["layer_overrides"] = {}
    return defaults


def check_compatible(saved: Any, config: TrainConfig, path: Path) -> None:
    """Refuse to resume `config` from a checkpoint whose saved config builds another model."""
    current = config.to_dict()
    for section in ARCHITECTURE_SECTIONS:
        saved_section = saved.get(section) if isinstance(saved, dict) else None
        if not isinstance(saved_section, dict):
            raise CheckpointError(f"{path}: its common state has no {section} settings; the "
                                  "checkpoint is corrupt")
        defaults = section_defaults(section)
        unknown = sorted(set(saved_section) - set(defaults) - set(current[section]))
        if unknown:
            raise CheckpointError(f"checkpoint {path} has {section}.{unknown[0]}, a setting this "
                                  "megamoe does not know; resume it with the release that wrote "
                                  "it")
        for key in sorted(set(saved_section) | set(current[section])):
            old = saved_section.get(key, defaults.get(key))
            new = current[section].get(key, defaults.get(key))
            if old != new:
                was = "" if key in saved_section else " (its default: the checkpoint predates it)"
                raise CheckpointError(
                    f"checkpoint {path} was trained with {section}.{key}={old!r}{was} but the "
                    f"config says {new!r}; use the checkpoint's model settings or a new "
                    "checkpoint.dir")
