"""What a test run builds once and every pytest-xdist worker reads (tests/conftest.py)."""
import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock


def build_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """`name` in the test run's base temporary folder, made by `build(path)` once per run: with
    pytest-xdist, once for all workers (the first to take the lock builds it, the others wait)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' folders gw0, gw1, ... lie in the run's
    target = root / name
    built = root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not built.exists():
            shutil.rmtree(target, ignore_errors=True)
            build(target)
            built.touch()
    return target
