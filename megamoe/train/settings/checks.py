"""The two checks every section of the trainer's config uses."""
from __future__ import annotations

from typing import Any

from megamoe.errors import ConfigError


def require(condition: bool, message: str) -> None:
    """Raise a ConfigError with `message` (one line naming the value and the fix) unless
    `condition` holds."""
    if not condition:
        raise ConfigError(message)


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    """`key`'s `value` is one of `choices`."""
    require(value in choices, f"{key}={value!r} is not one of {list(choices)}")
