"""Typed settings trees: dataclasses built from plain data (a YAML document, a checkpoint's saved
config), each field declaring whether it defines the model or only how it is trained.

- `model_setting` / `training_setting`: a dataclass field with its role. A model setting is one
  the weights' meaning depends on (a shape, a count, a kind, the gate function): resuming or
  initialising from a checkpoint refuses to change it. A training setting (a coefficient, a
  rate, a capacity, the dispatcher, dropout, jitter, a schedule) may change when a run resumes.
- `section(factory, kinds=...)`: a nested section; with `kinds` (a `megamoe.registry.Registry`)
  its `kind` key picks the settings class registered under that name, so each implementation
  declares its own settings beside its code.
- `build(cls, raw, prefix, where)`: the one reader of plain data into such a tree. Values are
  coerced to the annotated types (YAML 1.1 reads `3e-4` as a string), an unknown key is a
  one-line error with the closest known key, and each dataclass validates itself in
  `__post_init__`.
- `check_fields(settings, prefix)`: the same types for a tree made in Python, called first in
  each settings dataclass's `__post_init__`: a leaf of the wrong type (`topk="2"`, `topk=True`,
  a list where a number belongs) is a one-line error naming the field and the type; an int
  where a float belongs is read as that float. A section takes an instance of its class, a
  mapping of its settings (read by `build`, as a YAML document is) or the section's shorthand
  (`from_shorthand`, e.g. `balancing=["bias", "aux_loss"]`), and nothing else
  (`read_section`, which `build` uses for its sections too).
- `setting_roles`, `flat_values`, `deep_merge`: what resume checks and layer overrides use.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import reprlib
import typing
from dataclasses import MISSING, field
from typing import Any, Callable, Iterator, Optional, Union

from megamoe.errors import ConfigError, one_line

MODEL = "model"
TRAINING = "training"
ROLE = "megamoe.role"
KINDS = "megamoe.kinds"
MAX_INT = 2 ** 63 - 1
"""The largest magnitude of an integer setting (what torch and Megatron can hold)."""

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 60
_BRIEF.maxlist = _BRIEF.maxdict = 4
_BRIEF.maxlevel = 2


def model_setting(default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A field that defines the model: a checkpoint's value may not be changed on resume."""
    return field(default=default, default_factory=default_factory, metadata={ROLE: MODEL})


def training_setting(default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A field that says how the model is trained: a resumed run may change it."""
    return field(default=default, default_factory=default_factory, metadata={ROLE: TRAINING})


def section(factory: Callable[[], Any], kinds: Any = None) -> Any:
    """A nested settings section (its own fields carry their roles); with `kinds`, a registry
    whose entry named by the section's `kind` gives the section's class."""
    return field(default_factory=factory, metadata={KINDS: kinds} if kinds is not None else {})


def resolve_kind(settings: Any, registry: Any) -> None:
    """Fill a polymorphic section's `kind` from the registry when it was left None, and refuse
    a kind that is unknown or not configured by this class."""
    if settings.kind is None:
        settings.kind = registry.kind_of(type(settings))
        if settings.kind is None:
            raise ConfigError(f"{type(settings).__name__} configures no single "
                              f"{registry.field}; pass kind= (one of {list(registry.names())})")
    if settings.kind not in registry:
        raise unknown_choice(registry.field, settings.kind, registry.names())
    expected = registry.config_class(settings.kind)
    if not isinstance(settings, expected):
        raise ConfigError(f"{registry.field}={settings.kind!r} is configured by "
                          f"{expected.__name__}, not {type(settings).__name__}")


def shown(text: object, limit: int = 120) -> str:
    """`text` for a one-line message: control characters escaped, cut to `limit` characters."""
    text = str(text)
    text = text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
    return one_line(text)


def brief(value: Any) -> str:
    """`repr(value)` cut to a few dozen characters, for a one-line message."""
    return shown(_BRIEF.repr(value))


def closest(key: str, candidates: list[str]) -> Optional[str]:
    """The candidate closest to `key`, by whole key, else by its last dotted part."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1,
                                                                cutoff=0.6)]
    return close[0] if close else None


def unknown_key(key: str, where: str, candidates: list[str],
                fallback: str = "see the docstrings of megamoe.config") -> ConfigError:
    """An error naming `key` and the closest candidate."""
    key = str(key)  # a YAML key may be a number
    near = closest(key, candidates)
    hint = f"; did you mean '{near}'?" if near else f"; {fallback}"
    return ConfigError(f"unknown config key '{shown(key)}' {where}{hint}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a ConfigError unless setting `name`'s `value` is one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)}")


def unknown_choice(name: str, value: Any, choices: tuple[str, ...]) -> ConfigError:
    """An error naming `name`'s `value`, the choices, and the closest of them."""
    near = closest(str(value), list(choices))
    hint = f"; did you mean {near!r}?" if near else ""
    return ConfigError(f"{name}={brief(value)} is not one of {list(choices)}{hint}")


class _WrongType(ConfigError):
    """A value that is not of the type asked for (a Union tries its next option)."""


def _type_name(kind: Any) -> str:
    """`kind` as a reader says it: `float or None`, `list[float]`."""
    if typing.get_origin(kind) is Union:
        return " or ".join("None" if a is type(None) else _type_name(a)
                           for a in typing.get_args(kind))
    if typing.get_origin(kind) is not None:
        return str(kind).replace("typing.", "")
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def coerce(value: Any, kind: Any, key: str, text_numbers: bool = True) -> Any:
    """`value` as type `kind` (int, float, bool, str, Optional, Union, list, tuple, dict), or
    raise a ConfigError naming `key`. `text_numbers`: a string reads as a float (plain data:
    YAML 1.1 reads `3e-4` as a string); off for values given in Python, where a string is not a
    number (and a path is read as a str)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(value, option, key, text_numbers)
            except _WrongType:
                continue  # a value of the right type but out of range is refused as it is
    elif origin is list and isinstance(value, (list, tuple)):
        return [coerce(v, args[0], f"{key}[{i}]", text_numbers) for i, v in enumerate(value)]
    elif origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        return tuple(coerce(v, a, f"{key}[{i}]", text_numbers)
                     for i, (v, a) in enumerate(zip(value, args)))
    elif origin is dict or kind is dict:
        if isinstance(value, dict):
            return dict(value)
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:
                raise ConfigError(f"{key}={brief(value)} is out of range (at most {MAX_INT:,} "
                                  "in magnitude)")
            return value
    elif kind is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) <= MAX_INT or isinstance(value, float) else None
        elif isinstance(value, str) and text_numbers:  # YAML 1.1 reads `3e-4` as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}={brief(value)} is not a finite number; give a "
                                  "finite value")
            return number
    elif kind is str:
        if isinstance(value, str):
            return value
        path = os.fspath(value) if isinstance(value, os.PathLike) and not text_numbers else None
        if isinstance(path, str):
            return path
    raise _WrongType(f"{key}={brief(value)} is not a valid {_type_name(kind)}")


def _init_fields(kind: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(kind) if f.init}


def _section_class(settings_field: dataclasses.Field, declared: type, raw: Any,
                   prefix: str) -> type:
    """The class a section's plain data builds: its registry's entry for `raw["kind"]` (or the
    default's kind) when the section is polymorphic, else its declared class."""
    registry = settings_field.metadata.get(KINDS)
    if registry is None:
        return declared
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if kind is None:
        kind = settings_field.default_factory().kind
    if not isinstance(kind, str) or kind not in registry:
        raise unknown_choice(f"{prefix}.kind", kind, registry.names())
    return registry.config_class(kind)


def _setting_of_another_kind(kind: type, key: str, raw: dict, prefix: str, where: str,
                             registry: Any) -> Optional[ConfigError]:
    """The error for `key`, unknown to settings class `kind` of polymorphic section `prefix`
    but a setting of other kinds of `registry` (None when no kind has it)."""
    owners = [name for name, settings in registry.configured()
              if key in _init_fields(settings)]
    if not owners:
        return None
    chosen = raw.get("kind") or registry.kind_of(kind)
    section_name = prefix.rsplit(".", 1)[-1]
    return ConfigError(f"{prefix}.{shown(key)} {where} is not a setting of {section_name} "
                       f"{chosen!r} (it belongs to: {', '.join(owners)}); remove it or set "
                       f"{prefix}.kind to one of those")


def build(kind: type, raw: Any, prefix: str, where: str = "in the config",
          registry: Any = None) -> Any:
    """Dataclass `kind` from plain data `raw` (nested sections from nested mappings); each key
    checked against the fields (did-you-mean; for a section chosen from `registry` by its kind,
    a setting of another kind says whose it is), each value coerced to its field's type, each
    missing required field named. A `kind` instance is returned as it is."""
    if isinstance(raw, kind):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix} {where} must be a mapping of settings, not {brief(raw)}")
    fields = _init_fields(kind)
    hints = typing.get_type_hints(kind)
    values = {}
    for key, value in raw.items():
        if key not in fields:
            other = (_setting_of_another_kind(kind, key, raw, prefix, where, registry)
                     if registry is not None else None)
            raise other or unknown_key(f"{prefix}.{key}", where,
                                       [f"{prefix}.{name}" for name in fields])
        declared = hints[key]
        if dataclasses.is_dataclass(declared):
            values[key] = read_section(fields[key], declared, value, f"{prefix}.{key}", where)
        else:
            values[key] = coerce(value, declared, f"{prefix}.{key}")
    for name, settings_field in fields.items():
        if (name not in values and settings_field.default is MISSING
                and settings_field.default_factory is MISSING):
            raise ConfigError(f"{prefix}.{name} is missing {where}; it has no default")
    return kind(**values)


def read_section(settings_field: dataclasses.Field, declared: type, value: Any, key: str,
                 where: str) -> Any:
    """The value of section `key` (declared class `declared`) given as `value`: an instance of
    that class as it is, a mapping of its settings built by `build` (its class chosen by its
    `kind` when the section is polymorphic), or the section class's shorthand
    (`from_shorthand(value)`, described by its `SHORTHAND`); anything else is a one-line
    ConfigError naming `key` and the forms it takes."""
    if isinstance(value, declared):
        return value
    registry = settings_field.metadata.get(KINDS)
    if isinstance(value, dict):
        return build(_section_class(settings_field, declared, value, key), value, key, where,
                     registry)
    from_shorthand = getattr(declared, "from_shorthand", None)
    section_value = from_shorthand(value) if from_shorthand is not None else None
    if section_value is not None:
        return section_value
    shorthand = getattr(declared, "SHORTHAND", None)
    article = "an" if declared.__name__[0] in "AEIOU" else "a"
    forms = (f"a mapping of its settings{', ' + shorthand if shorthand else ''} or "
             f"{article} {declared.__name__} object")
    hint = ""
    if registry is not None and isinstance(value, str) and value in registry:
        hint = (f"; for {registry.field} {value!r} pass {{'kind': {value!r}}} or "
                f"{registry.config_class(value).__name__}()")
    given = "None" if value is None else f"a {type(value).__name__}"
    raise ConfigError(f"{key}={brief(value)} {where} must be {forms}, not {given}{hint}")


@functools.lru_cache(maxsize=None)
def _hints(kind: type) -> dict[str, Any]:
    """The resolved type of each init field of dataclass `kind` (cached: `check_fields` runs in
    every `__post_init__`)."""
    hints = typing.get_type_hints(kind)
    return {name: hints[name] for name in _init_fields(kind)}


def _checkable(kind: Any) -> bool:
    """Whether `coerce` knows type `kind` (a field of any other type is left to its class)."""
    origin = typing.get_origin(kind)
    if origin is not None:
        return origin in (Union, list, tuple, dict) and all(
            a is type(None) or a is Ellipsis or _checkable(a) for a in typing.get_args(kind))
    return kind in (int, float, bool, str, dict)


def check_fields(settings: Any, prefix: str = "") -> None:
    """Check and read the fields of settings dataclass `settings` as `build` reads plain data:
    each leaf as its annotated type (`coerce`: `topk="2"`, `topk=True` or a list where a number
    belongs are refused, an int where a float belongs becomes that float, a tuple where a list
    belongs that list; a string is no number here), each section by `read_section` (an
    instance, a mapping of its settings, or its shorthand). The first thing every settings
    dataclass's `__post_init__` does, so a tree made in Python is held to the types a YAML
    document is; `prefix` (e.g. "router"; "" at the top) starts each field's name in errors."""
    where = f"in {type(settings).__name__}"
    fields = _init_fields(type(settings))
    for name, declared in _hints(type(settings)).items():
        value = getattr(settings, name)
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(declared):
            checked = read_section(fields[name], declared, value, key, where)
        elif _checkable(declared):
            checked = coerce(value, declared, key, text_numbers=False)
        else:
            continue
        if checked is not value:
            setattr(settings, name, checked)


def dotted_keys(kind: type, prefix: str) -> list[str]:
    """Every dotted key of dataclass `kind` under `prefix`: each field, and the fields of its
    nested sections (of every class a polymorphic section's registry holds)."""
    hints = typing.get_type_hints(kind)
    keys: list[str] = []
    for settings_field in dataclasses.fields(kind):
        key = f"{prefix}.{settings_field.name}"
        keys.append(key)
        declared = hints[settings_field.name]
        if dataclasses.is_dataclass(declared):
            registry = settings_field.metadata.get(KINDS)
            classes = ([registry.config_class(name) for name in registry.names()] if registry
                       else [declared])
            for section_class in classes:
                keys += [k for k in dotted_keys(section_class, key) if k not in keys]
    return keys


def walk_fields(settings: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted name, field, value) of every leaf setting of a settings tree."""
    for settings_field in dataclasses.fields(settings):
        value = getattr(settings, settings_field.name)
        name = f"{prefix}{settings_field.name}"
        if dataclasses.is_dataclass(value):
            yield from walk_fields(value, f"{name}.")
        else:
            yield name, settings_field, value


def setting_roles(settings: Any, prefix: str = "") -> dict[str, str]:
    """{dotted name: MODEL or TRAINING} of every leaf setting of a settings tree (a leaf
    without a declared role is a model setting: a change is refused rather than missed)."""
    return {name: f.metadata.get(ROLE, MODEL) for name, f, _ in walk_fields(settings, prefix)}


def flat_values(data: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted name: value} of the leaves of nested plain data (mappings are descended into)."""
    if not isinstance(data, dict) or not data:
        return {prefix.rstrip("."): data} if prefix else {}
    values = {}
    for key, value in data.items():
        values.update(flat_values(value, f"{prefix}{key}."))
    return values


def deep_merge(base: dict, changes: dict) -> dict:
    """`base` with `changes` applied key by key, into nested mappings; a section whose `kind`
    changes is replaced whole (the other kind's settings do not apply)."""
    merged = dict(base)
    for key, value in changes.items():
        old = merged.get(key)
        if (isinstance(old, dict) and isinstance(value, dict)
                and value.get("kind", old.get("kind")) == old.get("kind")):
            merged[key] = deep_merge(old, value)
        else:
            merged[key] = value
    return merged
