"""The registries of the MoE core: every router, dispatcher and expert activation by the name a
config uses for it, each with the settings class it is configured by.

An implementation registers itself where it is defined, with its own settings dataclass beside
it (`@ROUTERS.register("threshold", config=ThresholdRouterConfig)`), and its package imports it,
so a new router is one file plus one import line in `megamoe/routing`. The `router` and
`dispatcher` sections of `MoEConfig` are built from the class registered under their `kind`
(`megamoe.settings`), and the layer builds what they name; no other list of names exists.

The built-in packages (BUILTIN_PACKAGES) are imported on a registry's first read, not when
megamoe is imported, so that a tool's refusal, or a helper process that only needs
`megamoe.checkpointing.no_orphans`, does not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, Optional, TypeVar

Entry = TypeVar("Entry")
BUILTIN_PACKAGES = ("megamoe.dispatch", "megamoe.experts", "megamoe.routing")
_builtins = {"imported": False}


def _import_builtins() -> None:
    """Import the packages whose modules register megamoe's own entries (once)."""
    if not _builtins["imported"]:
        _builtins["imported"] = True
        for package in BUILTIN_PACKAGES:
            importlib.import_module(package)


class Registry(Generic[Entry]):
    """Names -> implementations of one kind, each with the settings class that configures it
    (`config_class`); the config field `field` chooses among them."""

    def __init__(self, field: str) -> None:
        self.field = field
        self._entries: dict[str, Entry] = {}
        self._configs: dict[str, type] = {}

    def register(self, name: str, config: Optional[type] = None) -> Callable[[Entry], Entry]:
        """Decorator: register the decorated class or object under `name`, configured by
        `config` (a settings dataclass; None for entries without settings)."""
        def add(entry: Entry) -> Entry:
            self.add(name, entry, config)
            return entry
        return add

    def add(self, name: str, entry: Entry, config: Optional[type] = None) -> None:
        if name in self._entries:
            raise ValueError(f"{self.field} {name!r} is registered twice")
        self._entries[name] = entry
        if config is not None:
            self._configs[name] = config

    def _filled(self) -> "Registry[Entry]":
        _import_builtins()
        return self

    def names(self) -> tuple[str, ...]:
        return tuple(self._filled()._entries)

    def config_class(self, name: str) -> type:
        """The settings class registered with `name`."""
        return self._filled()._configs[name]

    def configured(self) -> list[tuple[str, type]]:
        """(name, settings class) of every entry registered with a settings class."""
        return list(self._filled()._configs.items())

    def kind_of(self, config: type) -> Optional[str]:
        """The one name registered with settings class `config` (None when none or several)."""
        names = [name for name, kind in self._filled()._configs.items() if kind is config]
        return names[0] if len(names) == 1 else None

    def snapshot(self) -> tuple[dict, dict]:
        """The current entries, for `restore` (a test or a documented example that registers
        its own entries puts the registry back as it was)."""
        return dict(self._filled()._entries), dict(self._configs)

    def restore(self, snapshot: tuple[dict, dict]) -> None:
        entries, configs = snapshot
        self._entries.clear()
        self._entries.update(entries)
        self._configs.clear()
        self._configs.update(configs)

    def __getitem__(self, name: str) -> Entry:
        return self._filled()._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._filled()._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._filled()._entries)


ROUTERS: Registry[type] = Registry("router.kind")
DISPATCHERS: Registry[type] = Registry("dispatcher.kind")
ACTIVATIONS: Registry = Registry("experts.activation")
