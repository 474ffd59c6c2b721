"""The registries of the MoE core: every router, dispatcher and expert activation by the name a
config uses for it.

An implementation registers itself where it is defined (`@ROUTERS.register("topk")`), and its
package imports it, so a new router is one file plus one import line in `megamoe/routing`.
`MoEConfig` validates `router_type`, `dispatcher` and `activation` against these names, and the
layer builds what they name; no other list of names exists.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    """Names -> implementations of one kind (the config field `field` chooses among them)."""

    def __init__(self, field: str) -> None:
        self.field = field
        self._entries: dict[str, Entry] = {}

    def register(self, name: str) -> Callable[[Entry], Entry]:
        """Decorator: register the decorated class or object under `name`."""
        def add(entry: Entry) -> Entry:
            self.add(name, entry)
            return entry
        return add

    def add(self, name: str, entry: Entry) -> None:
        if name in self._entries:
            raise ValueError(f"{self.field} {name!r} is registered twice")
        self._entries[name] = entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)


ROUTERS: Registry[type] = Registry("router_type")
DISPATCHERS: Registry[type] = Registry("dispatcher")
ACTIVATIONS: Registry = Registry("activation")
