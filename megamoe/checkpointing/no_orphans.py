"""Nothing a rank starts for checkpoint writing outlives the rank.

Megatron-Core's torch_dist writer (`strategies/filesystem_async.py`, 0.16.1 .. 0.19.x:
`_get_write_results_queue` / `get_write_results_queue`) starts a spawn-context
`multiprocessing.Manager()` on first save, for the queue its writer processes report to, and
keeps it in the module global `_results_queue`. A SIGKILLed rank cannot shut it down, so it
stayed alive (~270 MB) forever. `own_write_results_queue` starts that manager here, with an
initializer that asks the kernel to SIGKILL it when its parent dies (prctl PR_SET_PDEATHSIG),
and puts its queue into the global Megatron reads, so Megatron never starts its own. Megatron
0.16.1 also forks one short-lived writer process per bucket; `os.register_at_fork` gives every
process the rank forks the same parent-death signal.

The queue's items cross the manager as pickled bytes (`_BytesQueue`): were they Megatron's write
results themselves, the manager would unpickle them and so import torch, ~5 s of CPU and ~270 MB
in every rank that saves.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import sys
from multiprocessing.managers import SyncManager

_PR_SET_PDEATHSIG = 1
_state: dict = {}


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _BytesQueue:
    """The part of a queue Megatron's writer uses (`put`, `get`, `get_nowait`), over a manager
    queue that holds each item pickled, so the manager process never unpickles one. Items come
    only from this rank's own writer processes."""

    def __init__(self, queue) -> None:
        self._queue = queue

    def put(self, item, *args, **kwargs) -> None:
        self._queue.put(pickle.dumps(item), *args, **kwargs)

    def get(self, *args, **kwargs):
        return pickle.loads(self._queue.get(*args, **kwargs))

    def get_nowait(self):
        return pickle.loads(self._queue.get_nowait())


def own_write_results_queue() -> None:
    """Give Megatron's checkpoint writer a results queue whose manager dies with this rank
    (idempotent; call before the first `dist_checkpointing.save`)."""
    if _state.get("pid") == os.getpid():
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent)
    filesystem_async._results_queue = _BytesQueue(manager.Queue())
    if "fork_hook" not in _state:
        os.register_at_fork(after_in_child=die_with_parent)
        _state["fork_hook"] = True
    _state.update(pid=os.getpid(), manager=manager)
