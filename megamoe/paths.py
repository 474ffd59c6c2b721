"""Paths from untrusted places: a name read from a file, a link inside an input folder, an
output folder next to the input it is made from.

- `inside(folder, name)`: `folder / name` only if it stays inside `folder` once every link is
  followed (no absolute name, no `..` out of it, no symlink pointing elsewhere), so nothing
  outside an input folder is read or copied through a path in a file or a link.
- `refuse_overlap(output, inputs)`: a tool never writes over what it reads: the output may not
  be an input, lie inside one, or contain one.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from megamoe.errors import CheckpointError, ConfigError


def inside(folder: str | os.PathLike, name: str | os.PathLike) -> Path:
    """`folder / name`, refused (one-line CheckpointError) unless it resolves inside `folder`."""
    folder = Path(folder)
    text = os.fspath(name)
    candidate = folder / text
    if Path(text).is_absolute() or not _within(candidate.resolve(), folder.resolve()):
        shown = text if text.isprintable() else repr(text)
        how = ("a link to " + str(candidate.resolve())) if candidate.is_symlink() else shown
        raise CheckpointError(f"{folder}: {shown!s:.200} ({how:.200}) points outside the folder; "
                              "megamoe reads only files inside an input folder (copy the file "
                              "into it if it is meant to be read)")
    return candidate


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def refuse_overlap(output: str | os.PathLike, inputs: Iterable[str | os.PathLike],
                   flag: str = "--save") -> None:
    """A ConfigError if `output` is one of `inputs`, lies inside one or contains one (links
    followed): writing it would change or destroy what the tool reads."""
    target = Path(output).expanduser().resolve()
    for source in inputs:
        if source is None:
            continue
        origin = Path(source).expanduser().resolve()
        if _within(target, origin) or _within(origin, target):
            relation = ("is" if target == origin else "lies inside" if _within(target, origin)
                        else "contains")
            raise ConfigError(f"{flag} {output} {relation} the input {source}; the tool would "
                              f"write over what it reads: choose an output outside the input")
