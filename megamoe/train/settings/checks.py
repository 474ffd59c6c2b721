"""The check every section of the trainer's config uses (with `megamoe.settings.check_choice`)."""
from __future__ import annotations

from megamoe.errors import ConfigError


def require(condition: bool, message: str) -> None:
    """Raise a ConfigError with `message` (one line naming the value and the fix) unless
    `condition` holds."""
    if not condition:
        raise ConfigError(message)

