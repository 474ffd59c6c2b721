"""One run per output directory: rank 0 holds an exclusive `flock` on OUTPUT_DIR/.megamoe.lock
for the run's whole life.

The kernel releases the lock when the process ends, however it ends (a SIGKILL leaves no stale
lock behind). A second run on the same directory finds the lock taken and stops with one line
naming the holder (process id, host, start time, written into the lock file), exit code 2.
While it holds the lock, the run also removes the temporary folders (`.iter_*.tmp`) that an
interrupted save of an earlier run left in the checkpoint folder.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path
from typing import IO, Optional

import torch.distributed as dist

from megamoe.errors import ConfigError

LOCK_FILE = ".megamoe.lock"


class RunLock:
    """The exclusive lock of one output directory (held by one process)."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self._file: Optional[IO[str]] = None

    def acquire(self) -> Optional[str]:
        """Take the lock; None on success, else one line saying why not (the holder)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path, "a+")
        except OSError as err:
            return (f"output_dir {self.path.parent} cannot hold the run's lock file "
                    f"({err.strerror}); choose a writable output_dir")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read(200).strip() or "a process that has not yet said who it is"
            handle.close()
            return (f"output_dir {self.path.parent} is in use by another run ({holder}); wait "
                    "for it to end or choose another output_dir")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        self._file = handle
        return None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
