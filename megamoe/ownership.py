"""Which outputs a tool may write over: its own, and nothing else.

A tool that writes a folder marks it as its own with a file `MARK` holding the tool's name, and
replaces or deletes a folder only when it is absent, empty or carries that mark; an output that
must hold only its own files (a Hugging Face model folder, uploaded to the Hub as it is) carries
the same mark beside it instead, as `.<folder name>.megamoe-owner` in its parent. Any other
folder (a user's, the project's docs/, another tool's output, a folder written before marks
existed) is refused in one line and left as it was. A file output may replace a file, never a
folder or a device. No output may be, contain or lie inside one of the tool's inputs
(`megamoe.paths.refuse_overlap`). Each check runs when the arguments are read, before any work,
and again where the output is written.

- `check_folder_output` / `check_file_output`: the checks, for a command-line flag;
- `claim_folder`: make (or keep) a folder the tool owns and mark it;
- `fresh_folder`: an owned folder emptied for a new run inside it;
- `replace_folder`: put a finished temporary folder in place of an owned one (rename, so the
  output is whole or absent).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path
from typing import Iterable, Optional

from megamoe.errors import ConfigError
from megamoe.paths import refuse_overlap

MARK = ".megamoe-owner"
_MARK_BYTES = 256  # a tool's name; a longer file is not a mark


def outside_mark(folder: str | os.PathLike) -> Path:
    """Where the mark of a folder that holds only its own files lies: `.<name>.megamoe-owner`
    in its parent."""
    path = Path(folder).expanduser().resolve()
    return path.parent / f".{path.name}{MARK}"


def owner(folder: str | os.PathLike) -> Optional[str]:
    """The tool named by `folder`'s mark (inside it, else beside it), or None: no mark, or one
    that is not a small regular file (a link or a device is never a mark)."""
    return _read_mark(Path(folder) / MARK) or _read_mark(outside_mark(folder))


def _read_mark(path: Path) -> Optional[str]:
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MARK_BYTES:
            return None
        with open(path, "rb") as f:
            return f.read(_MARK_BYTES).decode("utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _is_empty(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return next(entries, None) is None
    except OSError as err:
        raise ConfigError(f"{folder} cannot be listed ({err.strerror}); choose a folder you can "
                          "read and write") from None


def _refuse_unowned(folder: Path, tool: str, flag: str, shown: str | os.PathLike) -> None:
    """A ConfigError naming `shown` unless `folder` (an existing folder) is empty or marked by
    `tool`."""
    if _is_empty(folder) or owner(folder) == tool:
        return
    marked = owner(folder)
    whose = f"it is {marked}'s output" if marked else f"it has no {MARK} naming {tool}"
    raise ConfigError(f"{flag} {shown} is a folder {tool} did not write ({whose}); {tool} "
                      f"replaces only its own folders: choose a new or empty folder (if it holds "
                      f"an earlier {tool} output written before marks existed, remove it or add "
                      f"the mark: echo {tool} > {folder / MARK})")


def check_folder_output(folder: str | os.PathLike, tool: str, flag: str,
                        inputs: Iterable[str | os.PathLike | None] = (),
                        overwrite: bool = True) -> Path:
    """`folder` (links followed) if `tool` may write it: it is not, does not contain and does
    not lie inside an input, and it is absent, an empty folder, or a folder marked by `tool`
    (and, unless `overwrite`, absent or empty). One-line ConfigError otherwise."""
    refuse_overlap(folder, inputs, flag)
    path = Path(folder).expanduser().resolve()
    if not path.exists():
        return path
    if not path.is_dir():
        raise ConfigError(f"{flag} {folder} is a file, not a folder; choose a folder path")
    if not overwrite and not _is_empty(path):
        raise ConfigError(f"{flag} {folder} exists; choose another path or pass --overwrite")
    _refuse_unowned(path, tool, flag, folder)
    return path


def check_file_output(path: str | os.PathLike, flag: str,
                      inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
    """`path` (links followed) if a file may be written there: not an input, not inside or
    around one, and absent or a regular file (a folder or a device is refused)."""
    refuse_overlap(path, inputs, flag)
    target = Path(path).expanduser().resolve()
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; name a file to write (e.g. "
                          f"{Path(path) / ('out' + Path(path).suffix)})")
    if target.exists() and not target.is_file():
        raise ConfigError(f"{flag} {path} is not a regular file; name a file to write")
    return target


def mark(folder: str | os.PathLike, tool: str, outside: bool = False) -> None:
    """Write `folder`'s mark naming `tool`: inside it, or with `outside` (an output that must
    hold only its own files) beside it, replaced atomically (`outside_mark`)."""
    if not outside:
        (Path(folder) / MARK).write_text(tool + "\n")
        return
    path = outside_mark(folder)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(tool + "\n")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def claim_folder(folder: str | os.PathLike, tool: str, flag: str,
                 inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
    """`folder` (links followed), created if absent and marked as `tool`'s, after
    `check_folder_output`: what it already holds is kept."""
    path = check_folder_output(folder, tool, flag, inputs)
    path.mkdir(parents=True, exist_ok=True)
    if owner(path) != tool:
        mark(path, tool)
    return path


def fresh_folder(folder: str | os.PathLike, tool: str, flag: str) -> Path:
    """`folder`, empty but for its mark: an owned folder is removed first, a folder of anyone
    else's refused (`check_folder_output`)."""
    path = check_folder_output(folder, tool, flag)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    mark(path, tool)
    return path


def replace_folder(tmp: str | os.PathLike, target: str | os.PathLike, tool: str,
                   flag: str, outside: bool = False) -> None:
    """Mark the finished folder `tmp` as `tool`'s and rename it to `target`; an existing
    `target` must be empty or `tool`'s (checked again here) and is removed only after the
    rename, so `target` is always whole. With `outside` the mark is written beside `target`
    once it is in place: a failure between leaves it unmarked (refused later), never a mark
    without its folder."""
    tmp, target = Path(tmp), Path(target)
    if not outside:
        mark(tmp, tool)
    if target.exists():
        check_folder_output(target, tool, flag)
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        try:
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.replace(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    if outside:
        mark(target, tool, outside=True)
