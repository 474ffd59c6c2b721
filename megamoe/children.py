"""Child processes that end with the tool that started them.

The study and benchmark tools train in child processes, several at a time from worker threads.
Ctrl-C reaches the children through the terminal's process group, but SIGTERM (`kill`, a
scheduler's time limit, a container stop) reaches only the tool: its children would go on
training and writing into the run folder of a study that is no longer there. `run_child` records
each child it starts; once a tool has called `end_children_on_sigterm` (from its main thread,
before it starts any), the first SIGTERM passes on to every child (a megamoe trainer checkpoints
and exits; one still alive after `GRACE_SECONDS` is killed), no child starts after it, and the
tool exits 143, the shell's code for a SIGTERM. A child's stdout can be echoed line by line
while it runs (`echo_prefix`), so a study shows each trainer's progress, not only its end.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import Optional

GRACE_SECONDS = 20.0

_running: set[subprocess.Popen] = set()
_stopping = threading.Event()


def run_child(command: list[str], echo_prefix: Optional[str] = None,
              **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, **popen_kwargs)`, from any
    thread, and ended with this process (see the module docstring). With `echo_prefix`, each
    line the child writes to stdout is also printed as it comes, after that prefix: a trainer's
    progress lines show while it runs."""
    if _stopping.is_set():
        raise SystemExit(128 + signal.SIGTERM)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **popen_kwargs) as child:
        _running.add(child)
        if _stopping.is_set():  # the handler listed the children before this one was added
            child.terminate()
        stderr: list[str] = []
        drain = threading.Thread(target=lambda: stderr.append(child.stderr.read()), daemon=True)
        drain.start()
        lines = []
        try:
            for line in child.stdout:
                lines.append(line)
                if echo_prefix is not None:
                    print(f"{echo_prefix}{line}", end="" if line.endswith("\n") else "\n",
                          flush=True)
            child.wait()
            drain.join()
        finally:
            _running.discard(child)
    if _stopping.is_set():
        raise SystemExit(128 + signal.SIGTERM)
    return subprocess.CompletedProcess(command, child.returncode, "".join(lines), stderr[0])


def end_children_on_sigterm() -> None:
    """From now on a SIGTERM to this process ends its children first (main thread only: Python
    runs signal handlers there)."""
    signal.signal(signal.SIGTERM, _end_children)


def _end_children(signum, frame) -> None:
    _stopping.set()
    children = list(_running)
    for child in children:
        child.terminate()
    for child in children:
        try:
            child.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
    print("stopped by SIGTERM: its child processes were ended", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)
