"""The registries of the MoE core: every router, dispatcher and expert activation by the name a
config uses for it, each with the settings class it is configured by.

An implementation registers itself where it is defined, with its own settings dataclass beside
it (`@ROUTERS.register("threshold", config=ThresholdRouterConfig)`), and its package imports it,
so a new router is one file plus one import line in `megamoe/routing`. The `router` and
`dispatcher` sections of `MoEConfig` are built from the class registered under their `kind`
(`megamoe.settings`), and the layer builds what they name; no other list of names exists.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, Optional, TypeVar

Entry = TypeVar("Entry")


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

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def config_class(self, name: str) -> type:
        """The settings class registered with `name`."""
        return self._configs[name]

    def configured(self) -> list[tuple[str, type]]:
        """(name, settings class) of every entry registered with a settings class."""
        return list(self._configs.items())

    def kind_of(self, config: type) -> Optional[str]:
        """The one name registered with settings class `config` (None when none or several)."""
        names = [name for name, kind in self._configs.items() if kind is config]
        return names[0] if len(names) == 1 else None

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)


ROUTERS: Registry[type] = Registry("router.kind")
DISPATCHERS: Registry[type] = Registry("dispatcher.kind")
ACTIVATIONS: Registry = Registry("experts.activation")
