"""One run per output directory: rank 0 holds an exclusive `flock` on the output directory
itself for the run's whole life.

The kernel releases the lock when the process ends, however it ends (a SIGKILL leaves no stale
lock behind), and nothing is written to take it: a refused run leaves the directory exactly as
it was. A second run on the same directory finds the lock taken and stops with one line naming
the holder (its process id and command line, read from the kernel's lock table
`/proc/locks`), exit code 2. While it holds the lock, the run also removes the temporary
folders (`.iter_*.tmp`) that an interrupted save of an earlier run left in the checkpoint
folder.
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
    """The exclusive lock of one output directory (held by one process)."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.directory = Path(output_dir)
        self._fd: Optional[int] = None
        self._created = False

    def acquire(self) -> Optional[str]:
        """Take the lock; None on success, else one line saying why not (the holder)."""
        try:
            self._created = not self.directory.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as err:
            return (f"output_dir {self.directory} cannot be created or opened "
                    f"({err.strerror}); choose a writable output_dir")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return (f"output_dir {self.directory} is in use by another run "
                    f"({_holder(self.directory)}); wait for it to end or choose another "
                    "output_dir")
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


def lock_output_dir(output_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike
                    ) -> RunLock:
    """On every rank together: rank 0 takes the lock of `output_dir` (every rank raises the
    same one-line ConfigError if another run holds it), then removes leftover temporary
    checkpoint folders. Returns the lock (held on rank 0 only) for the caller to release."""
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ConfigError(f"output_dir {output_dir} is a file, not a directory; choose another "
                          "output_dir")
    lock = RunLock(output_dir)
    refusal = [lock.acquire() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise ConfigError(refusal[0])
    if dist.get_rank() == 0:
        for leftover in Path(checkpoint_dir).glob(".iter_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier()
    return lock
