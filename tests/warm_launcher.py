"""Run megamoe's command-line programs as their own processes without paying the import of torch
and Megatron-Core for each one.

A test that runs `python -m megamoe.train ...` or `python tools/<tool>.py ...` calls `run(...)`
instead of `subprocess.run(...)`, with the same arguments and the same result
(`subprocess.CompletedProcess`, `subprocess.TimeoutExpired` past `timeout`). The command runs in
a process forked from a warm server, started once per test session, that has imported torch,
Megatron-Core and megamoe's trainer and converters (PRELOAD), and nothing else: the child takes
the caller's standard streams (passed over the server's Unix socket), working directory,
environment and argv, runs the module or script as `__main__` (`runpy`, as the interpreter
does), and exits through the interpreter's normal shutdown (atexit handlers, multiprocessing's
clean-up), with the program's exit status. `python -m torch.distributed.run --standalone
--nproc-per-node=N ...` forks N such children with the environment torchrun gives its workers
(RANK, WORLD_SIZE, MASTER_ADDR, ...), and ends as torchrun does: exit 0 when every rank does;
otherwise the other ranks get SIGTERM (SIGKILL 30 s later) and the exit status is 1.

Shell scripts (the documentation's bash blocks) get the same through `shim_environment()`: a
PATH whose `python` and `torchrun` are this file run as a client (`python warm_launcher.py
python ARGS...`), which hands the command to the server, or, when the server cannot run it,
replaces itself with the real program. In a forked child `sys.executable` is that `python`
shim, so what the command starts in turn with `sys.executable` (a study's trainer runs, their
torchrun) is served warm as well; the server runs requests side by side.

What still needs a fresh interpreter runs as one: interpreter flags (`-X importtime`, `-c`),
torchrun with other options than `--standalone --nproc-per-node=N`, a command given its own
`PYTHONPATH` (another copy of megamoe), and a test that passes `warm=False` or does not use this
module because it measures the process itself (memory, imports, signals to the launcher).
Environment variables read only when torch or Megatron-Core is imported keep the session's
values, so `OMP_NUM_THREADS` and `TORCHDYNAMO_DISABLE` are taken from the session's environment.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import re
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

import psutil

# Imported by the server before it forks: what the trainer and the converters would otherwise
# import themselves (torch, Megatron-Core and the rest come with megamoe's modules).
PRELOAD = ("sentencepiece", "tokenizers", "safetensors.torch", "megamoe.train.loop",
           "megamoe.train.config", "megamoe.interop.hf_export", "megamoe.interop.hf_import",
           "megamoe.upcycle", "megamoe.checkpointing.hf_moe_source")
SOCKET_VARIABLE = "WARM_LAUNCHER_SOCKET"
_TORCHRUN_STOP_S = 30.0  # torchrun's grace between SIGTERM and SIGKILL of the other workers


# ---------------------------------------------------------------------------------------------
# Messages: one JSON object per line; a request carries the caller's stdin, stdout and stderr.

def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _readable(files: Sequence, timeout: Optional[float]) -> list:
    """Those of `files` (sockets, file objects) that can be read, or have ended, within `timeout`
    seconds (None: no limit). poll, not select: select fails on a descriptor above 1023, which a
    long test session's process can reach."""
    poller = select.poll()
    by_fd = {file.fileno(): file for file in files}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    wait_ms = None if timeout is None else math.ceil(timeout * 1000)
    return [by_fd[fd] for fd, _ in poller.poll(wait_ms)]


def _receive(sock: socket.socket, timeout: Optional[float], buffer: bytearray) -> Optional[dict]:
    """The next message (None when `timeout` seconds pass first)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in buffer:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not _readable([sock], wait):
            return None
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise RuntimeError("the warm launcher closed the connection")
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


# ---------------------------------------------------------------------------------------------
# The server

def _become(request: dict, fds: list[int], rank_env: dict) -> None:
    """In a forked child: take the caller's streams, directory, environment and argv, then run
    the command as __main__."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**request["env"], **rank_env})
    _set_threads_as_a_fresh_process()
    kind, target, args = request["kind"], request["target"], request["args"]
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(target)) if kind == "script" else os.getcwd()
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def _set_threads_as_a_fresh_process() -> None:
    """torch's intra-op threads as a fresh interpreter with this environment starts with
    (OMP_NUM_THREADS, else one per physical core): the server's torch kept the count of its
    own environment, and a reduction split over another count of threads sums in another
    order (a torchrun worker gets OMP_NUM_THREADS=1)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    value = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(value) if value.isdigit() and int(value) > 0
                          else psutil.cpu_count(logical=False) or 1)


def _fork_ranks(request: dict, fds: list[int], closing: list[socket.socket],
                executable: str) -> list[int]:
    pids = []
    for rank_env in request["ranks"]:
        pid = os.fork()
        if pid == 0:
            for sock in closing:
                sock.close()
            # What the command starts in turn with sys.executable (a study's trainer runs, a
            # torchrun) goes through the shim, so it is served warm too.
            sys.executable = executable
            try:
                _become(request, fds, rank_env)
            except SystemExit:
                raise
            except BaseException:
                traceback.print_exc()
                sys.exit(1)
            sys.exit(0)
        pids.append(pid)
    return pids


class _Running:
    """One request's processes: their exit statuses as they end, and torchrun's way of ending
    several (the others get SIGTERM when one fails, SIGKILL _TORCHRUN_STOP_S later)."""

    def __init__(self, conn: socket.socket, pids: list[int]) -> None:
        self.conn, self.pids = conn, pids
        self.codes: dict[int, int] = {}
        self.stop_at: Optional[float] = None

    def running(self) -> list[int]:
        return [pid for pid in self.pids if pid not in self.codes]

    def exited(self, pid: int, code: int) -> None:
        self.codes[pid] = code
        if code != 0 and self.stop_at is None and len(self.pids) > 1:
            self.stop_at = time.monotonic() + _TORCHRUN_STOP_S
            _signal(self.running(), signal.SIGTERM)

    def stop_overdue(self) -> None:
        if self.stop_at is not None and time.monotonic() > self.stop_at:
            _signal(self.running(), signal.SIGKILL)
            self.stop_at = float("inf")

    def returncode(self) -> int:
        if len(self.pids) == 1:
            return self.codes[self.pids[0]]
        return 0 if not any(self.codes.values()) else 1


def _signal(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _start(listener: socket.socket, requests: list[_Running], executable: str,
           socket_path: str) -> _Running:
    """Accept one request and fork its processes."""
    conn, _ = listener.accept()
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    request = _receive(conn, 60, bytearray(data))
    request["env"][SOCKET_VARIABLE] = socket_path
    pids = _fork_ranks(request, fds, [listener, conn, *(r.conn for r in requests)], executable)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pids": pids})
    return _Running(conn, pids)


def _reap(requests: list[_Running]) -> None:
    """Collect every child that ended; answer and forget each request whose processes all
    ended."""
    owner = {pid: request for request in requests for pid in request.pids}
    while owner:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid in owner:
            owner[pid].exited(pid, os.waitstatus_to_exitcode(status))
    for request in list(requests):
        request.stop_overdue()
        if not request.running():
            _send(request.conn, {"returncode": request.returncode()})
            request.conn.close()
            requests.remove(request)


def serve(socket_path: str, preload: Sequence[str]) -> None:
    """Import `preload`, then run each request on `socket_path` in forked children, several at
    once (a command may start others through the shim), until standard input closes (the test
    session ended)."""
    import gc
    import importlib
    import warnings

    for name in preload:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except ImportError:
            pass
    # Children share the imported modules' pages until they write them; a collection in a
    # child would write every object's header (and so copy its page) but for frozen objects.
    gc.freeze()
    executable = _write_shims(Path(socket_path).parent / "bin")["python"]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    print("ready", flush=True)
    requests: list[_Running] = []
    while True:
        ready = _readable([listener, sys.stdin], 0.05 if requests else None)
        if sys.stdin in ready:
            break
        if listener in ready:
            requests.append(_start(listener, requests, executable, socket_path))
        _reap(requests)


# ---------------------------------------------------------------------------------------------
# The client side

_server: dict = {}


def _socket_path() -> str:
    """The socket of this session's server (started on first use)."""
    process = _server.get("process")
    if process is None or process.poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="warm-"), "socket")
        process = subprocess.Popen([sys.executable, __file__, "serve", path, ",".join(PRELOAD)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   env=os.environ.copy())
        if process.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the warm launcher did not start (exit {process.wait()})")
        atexit.register(_stop, process, path)
        _server.update(process=process, path=path)
    return _server["path"]


def _stop(process: subprocess.Popen, socket_path: str) -> None:
    """End the server (it stops when its standard input closes) and remove its socket."""
    process.stdin.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
    shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(args: Sequence[str]) -> Optional[tuple[str, str, list[str], int]]:
    """(kind, target, its arguments, processes) of a command the warm server runs:
    ("module", NAME, ..., 1) for `python -m NAME ...`, ("script", PATH, ..., 1) for
    `python PATH.py ...` (this interpreter), and N processes of either under
    `python -m torch.distributed.run --standalone --nproc-per-node=N`; else None."""
    args = [str(a) for a in args]
    if len(args) < 3 or args[0] != sys.executable:
        return None
    processes = 1
    if args[1:3] == ["-m", "torch.distributed.run"]:
        match = re.fullmatch(r"--nproc-per-node=(\d+)", args[4]) if len(args) > 6 else None
        if args[3] != "--standalone" or match is None:
            return None
        processes, args = int(match[1]), [args[0], *args[5:]]
    if args[1] == "-m" and args[2] != "pip":
        return "module", args[2], args[3:], processes
    if args[1].endswith(".py"):
        return "script", args[1], args[2:], processes
    return None


def _rank_environments(processes: int) -> list[dict[str, str]]:
    """What torchrun --standalone sets for each of its worker processes on one node."""
    if processes == 1:
        return [{}]
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes),
              "GROUP_RANK": "0", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(processes),
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": "warm",
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return [{**shared, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            for rank in range(processes)]


class _Launch:
    """One command handed to the server: its pids once started, its exit status when done."""

    def __init__(self, socket_path: str, command: tuple, cwd: str, env: dict,
                 fds: Sequence[int]) -> None:
        kind, target, args, processes = command
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        self.buffer = bytearray()
        _send(self.sock, {"kind": kind, "target": target, "args": args, "cwd": cwd, "env": env,
                          "ranks": _rank_environments(processes)}, fds)
        self.pids = _receive(self.sock, 60, self.buffer)["pids"]

    def wait(self, timeout: Optional[float]) -> Optional[int]:
        """The exit status, or None after killing every process when `timeout` passes."""
        done = _receive(self.sock, timeout, self.buffer)
        if done is None:
            _signal(self.pids, signal.SIGKILL)
            _receive(self.sock, 60, self.buffer)
        self.sock.close()
        return None if done is None else done["returncode"]


def run(args: Sequence[str], *, cwd=None, env: Optional[dict] = None,
        timeout: Optional[float] = None, capture_output: bool = True, text: bool = True,
        warm: bool = True) -> subprocess.CompletedProcess:
    """`subprocess.run(args, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True)`
    (the only form it takes), in processes forked from the warm server when `args` is
    `python -m MODULE ...` or `python SCRIPT.py ...`, alone or under torchrun --standalone."""
    if not (capture_output and text):
        raise TypeError("the warm launcher captures text output only")
    env = dict(os.environ if env is None else env)
    same_path = env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    command = _command(args) if warm and same_path else None
    if command is None:
        return subprocess.run(list(args), cwd=cwd, env=env, timeout=timeout, capture_output=True,
                              text=True)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            open(os.devnull, "rb") as stdin:
        launch = _Launch(_socket_path(), command, str(cwd or os.getcwd()), env,
                         [stdin.fileno(), out.fileno(), err.fileno()])
        code = launch.wait(timeout)
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    if code is None:
        raise subprocess.TimeoutExpired(list(args), timeout, stdout, stderr)
    return subprocess.CompletedProcess(list(args), code, stdout, stderr)


def _write_shims(shim_dir: Path) -> dict[str, str]:
    """`python` and `torchrun` scripts in `shim_dir` that run this file as a client (the real
    interpreter, `python warm_launcher.py PROGRAM ARGS...`); {program: path}."""
    shim_dir.mkdir(parents=True, exist_ok=True)
    shims = {}
    for program in ("python", "torchrun"):
        shim = shim_dir / program
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{__file__}" {program} "$@"\n')
        shim.chmod(0o755)
        shims[program] = str(shim)
    return shims


def shim_environment(shim_dir: Path, path: str) -> dict[str, str]:
    """PATH (`path` after `shim_dir`) and the server's socket for a shell whose `python` and
    `torchrun` should run warm: `shim_dir` gets the two scripts."""
    _write_shims(shim_dir)
    return {"PATH": f"{shim_dir}{os.pathsep}{path}",
            SOCKET_VARIABLE: _socket_path()}


def _shim(program: str, args: list[str]) -> None:
    """Run `program args` (python or torchrun, as a shell called it) through the server when it
    can, with this process's streams; else become the real program."""
    if program == "python":
        full = [sys.executable, *args]
    else:
        full = [sys.executable, "-m", "torch.distributed.run", *args]
    command = _command(full)
    socket_path = os.environ.get(SOCKET_VARIABLE)
    if command is None or socket_path is None:
        os.execv(sys.executable, full)
    launch = _Launch(socket_path, command, os.getcwd(), dict(os.environ), [0, 1, 2])
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda received, frame: _signal(launch.pids, received))
    code = launch.wait(None)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], [name for name in sys.argv[3].split(",") if name])
    else:
        _shim(sys.argv[1], sys.argv[2:])
