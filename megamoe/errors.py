"""The one exception type a user can cause, and the CLI wrapper that turns it into exit code 2."""
from __future__ import annotations

import argparse
import sys
from typing import Callable


class MegaMoEError(ValueError):
    """A problem with user input (config, checkpoint, data, CLI flags).

    The message names the offending value and the fix, in one line.
    """


class ConfigError(MegaMoEError):
    """An invalid configuration value or combination."""


class CheckpointError(MegaMoEError):
    """A missing, corrupt or incompatible checkpoint."""


class DataError(MegaMoEError):
    """Missing or malformed training data."""


def one_line(text: str) -> str:
    """TEXT with its control characters (a newline in a command-line argument or a path, say)
    written as escapes, so an error naming such a value stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    """Run a CLI `main`; a MegaMoEError becomes one line on stderr and exit code 2."""
    try:
        code = main(argv)
    except MegaMoEError as err:
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)


class CliArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one-line ConfigErrors (exit code 2 through `run_cli`)."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see --help)")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type`: a whole number >= `minimum` (a count, a size), refused in argparse's
    one line otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value
    return parse
