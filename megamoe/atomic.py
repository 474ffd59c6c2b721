"""Write-then-rename helpers: a failure never leaves a partial output behind."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megamoe.ownership import check_folder_output, replace_folder


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, owner: str, overwrite: bool = False,
                     outside_mark: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory that is renamed to `target` only on success, marked
    as the tool `owner`'s (megamoe.ownership; with `outside_mark`, beside `target` instead of
    inside it: an output that must hold only its own files).

    `target` may exist only when `overwrite` is set and it is empty or marked by `owner`; on any
    exception the temporary directory is removed and `target` is left untouched.
    """
    target = check_folder_output(target, owner, "output path", overwrite=overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        replace_folder(tmp, target, owner, "output path", outside=outside_mark)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
