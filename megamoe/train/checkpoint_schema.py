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
of a newer format than this megamoe's is refused. A common state with megamoe's keys
(`MEGAMOE_KEYS`) is megamoe's whatever else it holds: a format_version that is not an integer,
or a train_state or layout of the wrong shape or types, makes it a corrupt checkpoint (one
line), never one of another format whose checks would be skipped.

Resuming compares the saved `model` and `moe` settings with the config's, each with the
defaults of the current schema filled in, so a setting added after the checkpoint was written
reads as its default: an older checkpoint resumes as long as the config leaves new settings at
their defaults (a new setting's default keeps the behaviour it had before it existed). Only a
setting that differs, which would build a different model, refuses, naming it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

from megamoe.checkpointing.layout import TrainState
from megamoe.config import MoEConfig
from megamoe.errors import CheckpointError
from megamoe.train.config import ModelConfig, TrainConfig

FORMAT_VERSION = 1
UPGRADES: dict[int, Callable[[dict], dict]] = {}
"""format v -> the function that rewrites a format-v common state as format v + 1."""

ARCHITECTURE_SECTIONS = ("model", "moe")
"""The config sections that define the model; the others (parallel sizes, data, schedule,
checkpointing) may change on resume."""


MEGAMOE_KEYS = ("format_version", "train_state")
"""Common-state keys only megamoe writes, present in every format: a common state with either
is megamoe's, and is then read as megamoe's or refused as corrupt, never taken for another
format (Megatron-LM's is recognised by its own keys, see megatron_lm_state)."""


def is_megamoe_state(common: dict) -> bool:
    """Whether a common state was written by megamoe (any format version, well-formed or not)."""
    return any(key in common for key in MEGAMOE_KEYS)


def _is_count(value: Any, least: int = 0) -> bool:
    """An int (not a bool) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def upgraded(common: dict, path: Path) -> dict:
    """`common` rewritten as the current format (unchanged when it already is); a format_version
    that is not an integer (a string, a bool, missing) is a corrupt checkpoint."""
    version = common.get("format_version")
    if not _is_count(version):
        raise CheckpointError(f"{path}: its common state has format_version {version!r:.40} "
                              f"({type(version).__name__}), not a format number; the checkpoint "
                              "is corrupt (restore it or resume from another checkpoint)")
    if version > FORMAT_VERSION or version < 1:
        raise CheckpointError(f"{path} has checkpoint format {version}; this megamoe reads "
                              f"formats 1..{FORMAT_VERSION}: use the megamoe release that wrote "
                              "it (or a newer one)")
    while version < FORMAT_VERSION:
        common = {**UPGRADES[version](common), "format_version": version + 1}
        version += 1
    return common


def saved_position(common: dict, path: Path) -> tuple[TrainState, dict]:
    """(train_state, layout) of a current-format common state, each field checked for its type:
    train_state exactly {iteration, consumed_samples} as non-negative integers, layout parallel
    sizes as positive integers. Anything else is a one-line corrupt-checkpoint error naming the
    field."""
    saved, layout = common.get("train_state"), common.get("layout")
    fields = [field.name for field in dataclasses.fields(TrainState)]
    if not isinstance(saved, dict) or sorted(saved) != sorted(fields):
        problem = f"train_state {saved!r:.60} is not {{{', '.join(fields)}}}"
    else:
        problem = next((f"train_state.{name}={saved[name]!r:.40} is not a count"
                        for name in fields if not _is_count(saved[name])), None)
    if problem is None and not (isinstance(layout, dict) and layout and all(
            isinstance(name, str) and _is_count(size, 1) for name, size in layout.items())):
        problem = f"layout {layout!r:.60} is not a set of parallel sizes"
    if problem is not None:
        raise CheckpointError(f"{path}: its common state's {problem}; the checkpoint is corrupt "
                              "(restore it or resume from another checkpoint)")
    return TrainState(**saved), dict(layout)


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


TOKENIZER_KEY = "tokenizer"
"""Common-state key of the tokenizer a checkpoint's model was trained (or imported) with:
`megamoe.train.tokenizer.identity` plus (optionally) `source`, the path it was loaded from.
Absent from checkpoints older than it and from Megatron-LM's (then nothing is checked)."""
TOKENIZER_FIELDS = {"fingerprint": str, "kind": str, "vocab_size": int, "eod": int, "bos": int,
                    "add_bos": bool}


def saved_tokenizer(common: dict, path: Path) -> Optional[dict]:
    """The tokenizer identity a common state records (None when it has none); a record that is
    not a mapping of `TOKENIZER_FIELDS` (and a string `source`, if any) with a 64-digit hex
    fingerprint and ids inside the vocabulary is a corrupt checkpoint."""
    record = common.get(TOKENIZER_KEY)
    if record is None:
        return None
    wrong = "it is not a mapping" if not isinstance(record, dict) else next(
        (f"{name} is {record.get(name)!r:.40}" for name, kind in TOKENIZER_FIELDS.items()
         if type(record.get(name)) is not kind), None)
    if wrong is None and not isinstance(record.get("source", ""), str):
        wrong = f"source is {record['source']!r:.40}"
    if wrong is None:
        fingerprint, vocab = record["fingerprint"], record["vocab_size"]
        if len(fingerprint) != 64 or fingerprint.strip("0123456789abcdef"):
            wrong = f"fingerprint {fingerprint!r:.40} is not 64 hex digits"
        elif not 0 <= record["eod"] < vocab or not -1 <= record["bos"] < vocab:
            wrong = (f"eod {record['eod']} / bos {record['bos']} are not ids of its {vocab} "
                     "tokens")
    if wrong is not None:
        raise CheckpointError(f"{path}: the tokenizer record of its common state is malformed "
                              f"({wrong}); the checkpoint is corrupt (restore it or use "
                              "another checkpoint)")
    return record
