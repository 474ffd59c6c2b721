"""One run per output directory and per checkpoint folder: rank 0 holds an exclusive `flock` on
the output directory itself, and one on the checkpoint folder (`checkpoint.dir`, wherever it
lives: inside the output directory by default, or shared with another run's), for the run's
whole life. Two runs with their own output directories but one checkpoint folder would
otherwise write the same `iter_N` folders and tracker.

The kernel releases the lock when the process ends, however it ends (a SIGKILL leaves no stale
lock behind), and nothing is written to take it: a refused run leaves the directory exactly as
it was. A second run on the same directory finds the lock taken and stops with one line naming
the holder (its process id and command line, read from the kernel's lock table
`/proc/locks`), exit code 2, before anything is trained. While it holds the locks, the run also
removes the temporary folders (`.iter_*.tmp`) that an interrupted save of an earlier run left in
the checkpoint folder.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megamoe.errors import ConfigError


class RunLock:
    """The exclusive lock of one directory (held by one process), the value of the setting
    `setting` (named in the refusals)."""

    def __init__(self, directory: str | os.PathLike, setting: str = "output_dir") -> None:
        self.directory = Path(directory)
        self.setting = setting
        self._fd: Optional[int] = None
        self._created = False

    def acquire(self) -> Optional[str]:
        """Take the lock; None on success, else one line saying why not (the holder)."""
        try:
            self._created = not self.directory.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as err:
            return (f"{self.setting} {self.directory} cannot be created or opened "
                    f"({err.strerror}); choose a writable {self.setting}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return (f"{self.setting} {self.directory} is in use by another run "
                    f"({_holder(self.directory)}); wait for it to end or choose another "
                    f"{self.setting}")
        self._fd = fd
        return None

    def release(self) -> None:
        """Drop the lock; a directory the lock created is removed again if the run left it
        empty (a run refused before writing anything leaves no trace)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self._created:
                with contextlib.suppress(OSError):
                    self.directory.rmdir()  # only succeeds while empty


def _holder(directory: Path) -> str:
    """The process holding the flock of `directory`, from /proc/locks, with its command line."""
    stat = os.stat(directory)
    where = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        with open("/proc/locks") as locks:
            pids = [line.split()[4] for line in locks
                    if "FLOCK" in line and len(line.split()) > 5 and line.split()[5] == where]
    except OSError:
        pids = []
    if not pids:
        return "a process on another host, or one that just ended"
    try:
        with open(f"/proc/{pids[0]}/cmdline", "rb") as cmdline:
            command = " ".join(cmdline.read(300).decode(errors="replace").replace("\0", " ")
                               .split())
    except OSError:
        command = ""
    return f"pid {pids[0]}" + (f": {command}" if command else "")


class RunLocks:
    """The locks one run holds (rank 0 only; none on the other ranks), released newest first."""

    def __init__(self, locks: list[RunLock]) -> None:
        self.locks = locks

    def release(self) -> None:
        """Release every lock; a directory a lock created is removed if the run left it empty
        (the checkpoint folder before the output directory it may lie in)."""
        for lock in reversed(self.locks):
            lock.release()


def _take(directories: list[tuple[str | os.PathLike, str]]) -> tuple[list[RunLock],
                                                                      Optional[str]]:
    """Lock each (directory, setting) in turn, once per distinct directory; on a refusal the
    locks taken are released again. Returns the locks and the refusal (None when all held)."""
    locks: list[RunLock] = []
    for directory, setting in directories:
        if Path(directory).exists() and not Path(directory).is_dir():
            refusal = (f"{setting} {directory} is a file, not a directory; choose another "
                       f"{setting}")
        elif any(_same(directory, lock.directory) for lock in locks):
            continue  # flock twice in one process would refuse itself
        else:
            lock = RunLock(directory, setting)
            refusal = lock.acquire()
            if refusal is None:
                locks.append(lock)
                continue
        RunLocks(locks).release()
        return [], refusal
    return locks, None


def _same(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths are one directory (links followed)."""
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


def lock_output_dir(output_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike
                    ) -> RunLocks:
    """On every rank together: rank 0 locks `output_dir` and then `checkpoint_dir` (every rank
    raises the same one-line ConfigError if another run holds either, and nothing is left
    behind), then removes leftover temporary checkpoint folders. Returns the locks (held on
    rank 0 only) for the caller to release."""
    locks, refusal = (_take([(output_dir, "output_dir"), (checkpoint_dir, "checkpoint.dir")])
                      if dist.get_rank() == 0 else ([], None))
    refusals = [refusal]
    dist.broadcast_object_list(refusals, src=0)
    if refusals[0] is not None:
        raise ConfigError(refusals[0])
    if dist.get_rank() == 0:
        for leftover in Path(checkpoint_dir).glob(".iter_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier()
    return RunLocks(locks)
