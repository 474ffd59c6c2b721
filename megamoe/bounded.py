"""Reading untrusted text formats (YAML configs, JSON headers and configs, JSON lines) in bounded
time and memory, with one-line errors.

The formats set no limits of their own, so these do (docs/reliability.md):
- a file is read only when `os.stat` says it is a regular file of at most `max_bytes`
  (`regular_file_size`, `read_bytes_bounded`, `read_bounded`), a line up to `max_line_bytes`
  and no further (`bounded_lines`);
- text must be UTF-8: the first bad byte is named with its offset;
- nesting deeper than `MAX_DEPTH` and more than `MAX_NODES` values (counting every use of a
  YAML alias, so an alias bomb stops after `MAX_NODES` steps instead of expanding to 10^9) are
  refused, and so are integers of more than `MAX_INT_DIGITS` digits.
Each function raises the caller's error type (a `MegaMoEError`), naming what was read.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Iterator

import yaml

from megamoe.errors import MegaMoEError

MAX_DEPTH = 64
MAX_NODES = 1_000_000
MAX_INT_DIGITS = 40  # 2**128 has 39 digits: no setting or JSON size needs more


def regular_file_size(path: str | os.PathLike, max_bytes: int, error: type[MegaMoEError],
                      what: str) -> int:
    """The size of the regular file `path` (links followed), from `os.stat` and before any byte
    is read: a device, FIFO, socket or folder, a missing file, or a file larger than
    `max_bytes` is refused in one line."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise error(f"cannot read {what} ({err.strerror}); check the path") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise error(f"{what} is {kind}; pass a regular file")
    if info.st_size > max_bytes:
        raise error(f"{what} is {info.st_size:,} bytes, larger than {max_bytes:,}, the limit "
                    "for this file; is it the right file?")
    return info.st_size


def read_bytes_bounded(path: str | os.PathLike, max_bytes: int, error: type[MegaMoEError],
                       what: str) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes`: its size is checked with
    `regular_file_size` before anything is allocated, and a file that grows while it is read
    is refused at `max_bytes` + 1."""
    regular_file_size(path, max_bytes, error, what)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as err:
        raise error(f"cannot read {what} ({err.strerror}); check the path") from None
    if len(raw) > max_bytes:
        raise error(f"{what} is larger than {max_bytes:,} bytes, the limit for this file; "
                    "is it the right file?")
    return raw


def read_bounded(path: str | os.PathLike, max_bytes: int, error: type[MegaMoEError],
                 what: str) -> str:
    """The UTF-8 text of the regular file `path`, refused if it is larger than `max_bytes`."""
    return decode_utf8(read_bytes_bounded(path, max_bytes, error, what), error, what)


def decode_utf8(raw: bytes, error: type[MegaMoEError], what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset "
                    f"{err.start}); save it as UTF-8") from None


def bounded_lines(path: str | os.PathLike, max_line_bytes: int, error: type[MegaMoEError],
                  what: str) -> Iterator[tuple[int, str]]:
    """(line number, UTF-8 text) of each line of `path`; a line longer than `max_line_bytes`
    is refused as soon as that many bytes are read, so memory stays bounded."""
    with open(path, "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), 1):
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise error(f"{what}: line {number} is longer than {max_line_bytes:,} bytes, "
                            "the limit for one record; split it")
            yield number, decode_utf8(raw, error, f"{what}: line {number}")


def check_structure(value: Any, error: type[MegaMoEError], what: str,
                    max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> None:
    """Refuse `value` (parsed YAML or JSON) if it nests deeper than `max_depth` or holds more
    than `max_nodes` values, counting a shared value once per use; stops at the first limit."""
    stack, seen = [(value, 1)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > max_nodes:
            raise error(f"{what} holds more than {max_nodes:,} values (counting each use of a "
                        "YAML alias), the limit; is it the right file?")
        if depth > max_depth:
            raise error(f"{what} nests deeper than {max_depth} levels, the limit")
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for pair in node.items() for child in pair)
        elif isinstance(node, (list, tuple)):
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, int) and abs(node) >= 10 ** MAX_INT_DIGITS:
            raise error(f"{what} holds an integer of more than {MAX_INT_DIGITS} digits")


class _TooDeep(ValueError):
    pass


class _DepthLimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing to compose nodes nested deeper than MAX_DEPTH (its
    composer recurses once per level: from Python 3.12 a deep document runs for tens of
    seconds before Python's recursion limit stops it)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(f"nests deeper than {MAX_DEPTH} levels, the limit")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)` that stops at MAX_DEPTH levels: a syntax error raises
    yaml.YAMLError; too deep a document, or a value the constructor cannot read (an integer
    beyond Python's digit limit, a bad date), a ValueError whose text completes "<what> ..."."""
    try:
        return yaml.load(text, Loader=_DepthLimitedLoader)  # noqa: S506 - a SafeLoader
    except _TooDeep:
        raise
    except RecursionError:
        raise _TooDeep(f"nests deeper than Python can parse (the limit is {MAX_DEPTH} "
                       "levels)") from None
    except ValueError as err:  # e.g. an integer beyond Python's digit limit, a bad date
        raise ValueError(f"holds a value that cannot be read ({str(err)[:80]}); integers "
                         f"may have at most {MAX_INT_DIGITS} digits") from None


def parse_yaml(text: str, error: type[MegaMoEError], what: str,
               max_nodes: int = MAX_NODES) -> Any:
    """`load_yaml(text)` within the limits, every failure one line naming `what`."""
    try:
        value = load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise error(f"{what} is not valid YAML{at}; fix its syntax") from None
    except ValueError as err:
        raise error(f"{what} {err}") from None
    check_structure(value, error, what, max_nodes)
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def parse_json(text: str, error: type[MegaMoEError], what: str,
               max_nodes: int = MAX_NODES) -> Any:
    """`json.loads(text)` within the limits (at most `max_nodes` values); a syntax error names
    its position."""
    try:
        value = json.loads(text, parse_int=_bounded_int)
    except RecursionError:
        raise error(f"{what} nests deeper than Python can parse; the limit is {MAX_DEPTH} "
                    "levels") from None
    except json.JSONDecodeError as err:
        raise error(f"{what}: not valid JSON ({err.msg} at line {err.lineno}, column "
                    f"{err.colno})") from None
    except ValueError as err:
        raise error(f"{what} holds {str(err)[:80]}; the limit is {MAX_INT_DIGITS} "
                    "digits") from None
    check_structure(value, error, what, max_nodes=max_nodes)
    return value


def read_json(path: str | os.PathLike, max_bytes: int, error: type[MegaMoEError],
              what: str | None = None) -> Any:
    """The JSON document in the file `path` (at most `max_bytes`), within the limits."""
    what = what or str(Path(path))
    return parse_json(read_bounded(path, max_bytes, error, what), error, what)
