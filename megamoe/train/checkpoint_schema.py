"""The versioned schema of what a megamoe training checkpoint keeps of its run, how a checkpoint
written by an older megamoe is read, and which of its settings a resumed run may change.

Format 2 (from the settings tree, issue 47), in the checkpoint's common state:
    format_version  2
    config          the run's TrainConfig as plain data (`TrainConfig.to_dict`): the `moe`
                    section is the nested tree of `megamoe.config.MoEConfig` (router, balancing,
                    dispatcher, experts, shared_expert; no hidden_size, which is the model's)
                    with `layer_overrides: {layer: nested partial tree}`
    train_state     {iteration, consumed_samples}
    layout          the parallel sizes it was saved at
    lr_schedule     the learning-rate schedule
Format 1 (megamoe before the tree) kept the same keys with a flat `moe` section (MoEConfig's 38
flat names, `megamoe.config.FLAT_NAMES`), flat layer overrides, and `guards.debug_*`.

Upgrades: `UPGRADES[v]` turns the common state of format v into format v + 1 (renamed or
removed settings are rewritten there, so nothing else needs to know old formats); a checkpoint
of a newer format than this megamoe's is refused. A common state with megamoe's keys
(`MEGAMOE_KEYS`) is megamoe's whatever else it holds: a format_version that is not an integer,
or a train_state or layout of the wrong shape or types, makes it a corrupt checkpoint (one
line), never one of another format whose checks would be skipped.

Resuming reads the saved `model` and `moe` sections through the current schema (so a setting
added after the checkpoint was written, or one it does not record, reads as its default, which
keeps the behaviour it had before it existed) and compares every setting with the config's, per
MoE layer with its overrides. Each setting has a role (`megamoe.settings`): a changed model
setting (a shape, a count, a kind, anything the weights' meaning depends on) refuses, naming it;
a changed training setting (a coefficient, a rate, the dispatcher, dropout) is returned, for the
trainer to announce and record (`SettingChange`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

from megamoe.checkpointing.layout import TrainState
from megamoe.errors import CheckpointError, MegaMoEError
from megamoe.registry import ROUTERS
from megamoe.settings import MODEL, TRAINING, build, flat_values, setting_roles, walk_fields
from megamoe.train.config import TrainConfig, config_from_dict
from megamoe.train.settings.moe import nest_moe_section
from megamoe.train.settings.optimizer import OptimizerConfig

FORMAT_VERSION = 2


class SettingChange(NamedTuple):
    """A training setting a run changed from the checkpoint it starts from."""

    name: str
    """Its dotted name, e.g. `moe.balancing.aux_loss_coeff` or
    `moe.layer_overrides.3.balancing.aux_loss_coeff`."""
    old: Any
    new: Any


def _unannounced(old: str, new: str) -> None:
    """A checkpoint's older names are read as the new ones without a note (the user did not
    write them)."""


def _own_router_settings(moe: Any, base_router: Optional[dict] = None) -> Any:
    """Nested MoE settings (the section, or a layer's overrides over `base_router`, the
    section's router) without the settings of other routers than the one they pick (format 1
    kept them, without effect). An override that picks another router keeps the section's
    common router settings that router has, which format 1 applied to it (format 2 replaces a
    router section of another kind whole)."""
    if not isinstance(moe, dict):
        return moe
    router = moe.get("router")
    if not isinstance(router, (dict, type(None))) or (router is None and base_router is None):
        return moe
    router, inherited = dict(router or {}), dict(base_router or {})
    kind = router.get("kind", inherited.get("kind", "topk"))
    if not isinstance(kind, str) or kind not in ROUTERS:
        return moe  # refused by name when the settings are read
    known = {f.name for f in dataclasses.fields(ROUTERS.config_class(kind))}
    if base_router is not None and kind != inherited.get("kind", "topk"):
        router = {**inherited, **router}
    router = {key: value for key, value in router.items() if key in known}
    return {**{k: v for k, v in moe.items() if k != "router"}, **({"router": router} if router
                                                                  else {})}


def _upgrade_1(common: dict) -> dict:
    """Format 1 -> 2: the saved config's `moe` section as the tree (flat names nested by
    `megamoe.train.settings.moe.nest_moe_section`, in the section and in each layer's
    overrides, without a note; router settings of other routers dropped,
    `_own_router_settings`) and the fault-injection keys `guards.debug_*` removed. Malformed
    data is left for the reader to refuse."""
    config = common.get("config")
    if not isinstance(config, dict):
        return common
    config = dict(config)
    moe = config.get("moe")
    if isinstance(moe, dict):
        try:
            moe = nest_moe_section(moe, _unannounced)
        except MegaMoEError as err:
            raise CheckpointError(f"its saved moe settings cannot be read ({err}); the "
                                  "checkpoint is corrupt") from None
        moe = _own_router_settings(moe)
        overrides = moe.get("layer_overrides")
        if isinstance(overrides, dict):
            base_router = moe.get("router") if isinstance(moe.get("router"), dict) else {}
            moe["layer_overrides"] = {layer: _own_router_settings(part, base_router)
                                      for layer, part in overrides.items()}
        config["moe"] = moe
    guards = config.get("guards")
    if isinstance(guards, dict):
        config["guards"] = {k: v for k, v in guards.items() if not str(k).startswith("debug_")}
    return {**common, "config": config}


UPGRADES: dict[int, Callable[[dict], dict]] = {1: _upgrade_1}
"""format v -> the function that rewrites a format-v common state as format v + 1."""

ARCHITECTURE_SECTIONS = ("model", "moe")
"""The config sections that hold the model's settings (each setting's role says whether a
resumed run may change it); the others (parallel sizes, data, schedule, checkpointing) may
change on resume."""


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
        try:
            common = {**UPGRADES[version](common), "format_version": version + 1}
        except CheckpointError as err:
            raise CheckpointError(f"{path}: {err}") from None
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


def saved_settings(sections: Any, path: Path) -> TrainConfig:
    """The `model` and `moe` sections a checkpoint records (a current-format saved config, or a
    converter's record), read as a training config through the current schema: what it leaves
    out takes the current default. Sections that are not mappings are a corrupt checkpoint;
    settings this megamoe cannot build (an unknown key, a value it refuses) are named."""
    for section in ARCHITECTURE_SECTIONS:
        if not (isinstance(sections, dict) and isinstance(sections.get(section), dict)):
            raise CheckpointError(f"{path}: its common state has no {section} settings; the "
                                  "checkpoint is corrupt")
    try:
        return config_from_dict({"model": sections["model"], "moe": sections["moe"]},
                                f"in the common state of {path}", note=_unannounced)
    except MegaMoEError as err:
        raise CheckpointError(f"checkpoint {path} records model settings this megamoe cannot "
                              f"read ({err}); use the megamoe release that wrote it") from None


class _Setting(NamedTuple):
    """One setting as a checkpoint records it and as the run's config says."""

    name: str
    role: str
    old: Any
    new: Any
    written: bool
    """Whether the checkpoint wrote the setting (else `old` is its default)."""


def _written(raw: Any, dotted: str) -> bool:
    """Whether nested plain data `raw` holds the setting named `dotted`."""
    for part in dotted.split("."):
        if not isinstance(raw, dict) or part not in raw:
            return False
        raw = raw[part]
    return True


def _compared(old_tree: Any, new_tree: Any, prefix: str, raw: Any) -> Iterator[_Setting]:
    """Every setting of two settings trees, in tree order with the `kind`s first, with its role
    (the new tree's, else the old one's: a setting of the saved kind's class when a kind
    changed)."""
    old_values = {key: value for key, _, value in walk_fields(old_tree)}
    new_values = {key: value for key, _, value in walk_fields(new_tree)}
    roles = {**setting_roles(old_tree), **setting_roles(new_tree)}
    keys = list(new_values) + [key for key in old_values if key not in new_values]
    keys.sort(key=lambda key: key.rpartition(".")[2] != "kind")
    for key in keys:
        yield _Setting(f"{prefix}{key}", roles.get(key, MODEL), old_values.get(key),
                       new_values.get(key), _written(raw, key))


def _settings(saved: TrainConfig, raw: dict, config: TrainConfig) -> Iterator[_Setting]:
    """The model section's settings, the MoE section's, then each overridden MoE layer's that
    its override (saved or current) sets, named `moe.layer_overrides.<layer>.<setting>`."""
    yield from _compared(saved.model, config.model, "model.", raw.get("model"))
    yield from _compared(saved.moe_config(), config.moe_config(), "moe.", raw.get("moe"))
    saved_layers, layers = saved.moe.layer_overrides, config.moe.layer_overrides
    raw_layers = raw.get("moe", {}).get("layer_overrides") or {}
    for layer in sorted(set(saved_layers) | set(layers)):
        overridden = set(flat_values(saved_layers.get(layer, {}))) | set(
            flat_values(layers.get(layer, {})))
        written = raw_layers.get(layer, {})
        for setting in _compared(saved.moe_config(layer), config.moe_config(layer), "", None):
            if setting.name in overridden:
                yield setting._replace(name=f"moe.layer_overrides.{layer}.{setting.name}",
                                       written=_written(written, setting.name)
                                       or _written(raw.get("moe"), setting.name))


def check_compatible(saved: Any, config: TrainConfig, path: Path) -> list[SettingChange]:
    """Refuse to resume `config` from a checkpoint whose saved config (current format) differs
    in a model setting, naming the first (a changed `kind` before the settings of its section);
    return the training settings that changed, in the same order."""
    settings = saved_settings(saved, path)
    changes = []
    for setting in _settings(settings, saved, config):
        if setting.old == setting.new:
            continue
        if setting.role != TRAINING:
            was = "" if setting.written else (" (its default: the checkpoint does not record "
                                              "it)")
            raise CheckpointError(
                f"checkpoint {path} was trained with {setting.name}={setting.old!r}{was} but "
                f"the config says {setting.new!r}; {setting.name} is a model setting: use the "
                "checkpoint's value or a new checkpoint.dir")
        changes.append(SettingChange(setting.name, setting.old, setting.new))
    return changes


def optimizer_changes(saved: Any, config: TrainConfig, path: Path) -> list[SettingChange]:
    """The optimizer settings, and `training.grad_clip`, that a resumed run's `config` changes
    from those its checkpoint's saved config records (those it does not record are not
    compared). Each takes effect from the resumed step: the schedule is a function of the step,
    the clip and QK-clip are built from the config, and every step sets each parameter group's
    rate, weight decay, betas and eps from it (`schedule.apply_step_settings`; Muon keeps its
    own settings on load). `optimizer.name` is checked before (`check_resumed_optimizer`)."""
    saved = saved if isinstance(saved, dict) else {}
    raw, changes = saved.get("optimizer"), []
    if isinstance(raw, dict):
        try:
            old = build(OptimizerConfig, raw, "optimizer", f"in the saved config of {path}")
        except MegaMoEError as err:
            raise CheckpointError(f"checkpoint {path} records optimizer settings this megamoe "
                                  f"cannot read ({err}); use the megamoe release that wrote "
                                  "it") from None
        changes += [SettingChange(s.name, s.old, s.new)
                    for s in _compared(old, config.optimizer, "optimizer.", raw)
                    if s.written and s.old != s.new]
    training = saved.get("training")
    if isinstance(training, dict) and "grad_clip" in training and \
            training["grad_clip"] != config.training.grad_clip:
        changes.append(SettingChange("training.grad_clip", training["grad_clip"],
                                     config.training.grad_clip))
    return changes


def training_changes(sections: Any, config: TrainConfig, path: Path,
                     recorded_only: bool = False) -> list[SettingChange]:
    """The training settings `config` changes from the model settings a checkpoint records
    (`sections`, see `saved_settings`), for `checkpoint.init_from`, whose weights must fit (see
    checkpoint_shapes) but whose other model settings a new run may choose. `recorded_only`:
    only the settings `sections` writes (a converter's record, whose model was never trained
    with the settings it leaves out)."""
    return [SettingChange(s.name, s.old, s.new)
            for s in _settings(saved_settings(sections, path), sections, config)
            if s.role == TRAINING and s.old != s.new and (s.written or not recorded_only)]


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
