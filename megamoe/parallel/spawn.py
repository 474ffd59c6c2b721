"""Run a function on N real ranks on this machine (spawned processes, gloo), bounded in time.

Each rank runs `fn(rank, world_size, **kwargs)` in a fresh spawned process whose environment
holds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (so `env://` initialisation and
`setup_megatron` find their peers), with one intra-op thread. The return value (tensors, numbers,
strings, and lists, tuples or dicts of them) comes back through `torch.save` and is read with
`weights_only=True`. Used by the memory planner's `--measure` and by the distributed tests.

A program that starts many groups of ranks (a test session) calls `start_from_forkserver` once:
later ranks are then forked from one server process that imported the given modules (torch,
Megatron-Core, ...) when it started, instead of each importing them again.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any, Callable, Iterable

import torch
import torch.multiprocessing as mp


_START = {"method": "spawn"}


def start_from_forkserver(preload: Iterable[str]) -> None:
    """Start every later group of ranks from a forkserver that imports `preload` once.

    The server starts with the first group and keeps this process's `sys.path` and environment
    of that moment; each rank still sets its own RANK, WORLD_SIZE, ... as under "spawn"."""
    mp.set_forkserver_preload(list(preload))
    _START["method"] = "forkserver"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(rank: int, world_size: int, port: int, fn: Callable, kwargs: dict,
              out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHDYNAMO_DISABLE="1")
    torch.set_num_threads(1)
    try:
        result = {"value": fn(rank, world_size, **kwargs)}
    except BaseException:  # noqa: BLE001 - reported to the parent process
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    # Skip interpreter teardown (process groups with a dead peer can block in their destructors),
    # but first end this rank's own children (dist_checkpointing's multiprocessing manager).
    for child in mp.active_children():
        child.terminate()
    os._exit(0)


def spawn_ranks(world_size: int, fn: Callable, out_dir: str, timeout_s: float,
                may_die: Iterable[int] = (), **kwargs: Any) -> list[Any]:
    """Results of fn on ranks 0..world_size-1 (None for a rank in `may_die` that left none).

    Raises RuntimeError with the rank's traceback if a rank failed, and TimeoutError (after
    killing every rank still alive) if the ranks did not all finish within `timeout_s`.
    """
    os.makedirs(out_dir, exist_ok=True)
    context = mp.get_context(_START["method"])
    port = _free_port()
    # Not daemonic: dist_checkpointing.save starts a multiprocessing manager.
    procs = [context.Process(target=_run_rank,
                             args=(rank, world_size, port, fn, kwargs, out_dir))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in alive:
        procs[rank].kill()
        procs[rank].join()
    if alive:
        raise TimeoutError(f"ranks {alive} of {world_size} still running after {timeout_s}s")
    results = []
    for rank, proc in enumerate(procs):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        if not os.path.exists(path):
            if rank in may_die:
                results.append(None)
                continue
            raise RuntimeError(f"rank {rank} exited with code {proc.exitcode} and no result")
        result = torch.load(path, weights_only=True)
        if "error" in result:
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{result['error']}")
        results.append(result["value"])
    return results
