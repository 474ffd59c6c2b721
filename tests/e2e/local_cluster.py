"""A real two-node SLURM cluster on this one machine, for end-to-end tests of the launch scripts.

Debian's `slurm-wlm` and `munge` packages provide the daemons (installed with apt-get when
`slurmctld` is missing). Everything lives under one folder of the caller's choosing: the munge key,
`slurm.conf`, controller state, node spool folders and logs; only munge's socket sits in a short
folder under /tmp (see `munge_socket_path`). The daemons run in the foreground as processes
started here; their pids are written to `DIR/pids.json`, and stopping the cluster signals exactly
those pids, nothing found by name. Each daemon also dies with the process that started it (Linux's
parent-death signal), so a test run that is killed or interrupted leaves no daemon behind.

The two nodes share the machine: the first is named after `hostname -s`, the second `localhost`,
because launch scripts use the first node's name as a rendezvous address, so both names must
resolve. Each node owns an equal share of the machine's CPUs and memory.

Library use (tests)::

    cluster = start_cluster(tmp_dir)          # installs Slurm if needed, waits for idle nodes
    result = cluster.run_job(script, sbatch_args=["--nodes=2"], timeout=120)
    assert result.state == "COMPLETED"
    cluster.teardown()

`cluster.env` (the environment with SLURM_CONF) serves any other Slurm command.

Command line (humans)::

    python tests/e2e/local_cluster.py up DIR     # prints the `export SLURM_CONF=...` line to use
    python tests/e2e/local_cluster.py down DIR
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

# Debian installs the daemons into /usr/sbin, which is missing from many non-login PATHs.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
_POLL_S = 0.2
# Job states after which a job never runs again (a requeued job passes through REQUEUED/PENDING).
_FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                 "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}


class ClusterError(RuntimeError):
    """The local cluster could not be installed, started or stopped; the message says why."""


@dataclass(frozen=True)
class JobResult:
    """How a batch job ended, as `scontrol show job` reports it."""

    job_id: int
    state: str       # COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    exit_code: str   # "status:signal" of the batch script, e.g. "0:0"
    restarts: int    # how often the job was requeued


@dataclass
class LocalCluster:
    """A running local cluster: its folder, node names and the daemon pids started for it."""

    root: Path
    nodes: tuple[str, ...]
    pids: dict[str, int]
    _children: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    @property
    def conf(self) -> Path:
        """The cluster's slurm.conf."""
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment plus SLURM_CONF, for sbatch/srun/squeue/sinfo calls."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def submit(self, script: str | Path, *script_args: str, sbatch_args: Sequence[str] = (),
               cwd: str | Path | None = None, env: dict[str, str] | None = None) -> int:
        """Submit `script` with sbatch (extra `env` on top of `self.env`); return the job id."""
        cmd = ["sbatch", "--parsable", *sbatch_args, str(script), *script_args]
        done = subprocess.run(cmd, env={**self.env, **(env or {})}, cwd=cwd, capture_output=True,
                              text=True, timeout=30)
        if done.returncode != 0:
            raise ClusterError(f"sbatch failed: {_last_line(done.stderr)}")
        return int(done.stdout.strip().split(";")[0])

    def wait(self, job_id: int, timeout: float) -> JobResult:
        """Poll the job until it has ended for good (through any requeues); cancel it on timeout.

        Faster than `sbatch --wait`, whose polling interval grows to 32 s.
        """
        deadline = time.monotonic() + timeout
        while True:
            info = _run_quiet(["scontrol", "show", "job", "--oneliner", str(job_id)], self.env,
                              timeout=10)
            fields = dict(re.findall(r"(\w+)=(\S*)", info))
            if fields.get("JobState") in _FINAL_STATES:
                return JobResult(job_id, fields["JobState"], fields.get("ExitCode", ""),
                                 int(fields.get("Restarts", 0)))
            if time.monotonic() > deadline:
                _run_quiet(["scancel", str(job_id)], self.env, timeout=10)
                raise ClusterError(f"job {job_id} still {fields.get('JobState', 'unknown')} after "
                                   f"{timeout:.0f} s; cancelled it")
            time.sleep(_POLL_S)

    def run_job(self, script: str | Path, *script_args: str, sbatch_args: Sequence[str] = (),
                cwd: str | Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 300.0) -> JobResult:
        """Submit `script` and wait until the job has ended: `submit` then `wait`."""
        job_id = self.submit(script, *script_args, sbatch_args=sbatch_args, cwd=cwd, env=env)
        return self.wait(job_id, timeout)

    @classmethod
    def from_dir(cls, root: str | Path) -> "LocalCluster":
        """The cluster recorded in `root/pids.json` by an earlier `start_cluster(root)`."""
        root = Path(root).resolve()
        record = root / "pids.json"
        if not record.is_file():
            raise ClusterError(f"no local cluster recorded in {root} (missing {record.name}); "
                               f"start one with `up {root}`")
        data = json.loads(record.read_text())
        return cls(root=root, nodes=tuple(data["nodes"]), pids=dict(data["pids"]))

    def running(self) -> list[str]:
        """Names of this cluster's daemons that are still alive."""
        return [name for name, pid in self.pids.items() if self._is_alive(name, pid)]

    def teardown(self, timeout: float = 20.0) -> None:
        """Cancel all jobs, then stop the daemons by the pids started for them.

        A daemon still alive `timeout` seconds after SIGTERM gets SIGKILL.
        """
        if "slurmctld" in self.running():
            # Let slurmd clean up its job steps before it stops.
            _run_quiet(["scancel", "--user", str(os.getuid())], self.env, timeout=10)
            deadline = time.monotonic() + timeout
            while _run_quiet(["squeue", "--noheader"], self.env, timeout=10).strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
        # Nodes first, then the controller, munge last: each still has what it needs to shut down.
        for name in sorted(self.pids, key=_stop_order):
            pid = self.pids[name]
            if not self._is_alive(name, pid):
                continue
            _signal(pid, signal.SIGTERM)
            if not self._wait_dead(name, pid, timeout):
                _signal(pid, signal.SIGKILL)
                if not self._wait_dead(name, pid, timeout):
                    raise ClusterError(f"{name} (pid {pid}) survived SIGKILL for {timeout:.0f} s")
        (self.root / "pids.json").unlink(missing_ok=True)
        shutil.rmtree(munge_socket_path(self.root).parent, ignore_errors=True)

    def _is_alive(self, name: str, pid: int) -> bool:
        child = self._children.get(name)
        if child is not None:
            return child.poll() is None
        return _pid_alive(pid) and str(self.root) in _cmdline(pid)

    def _wait_dead(self, name: str, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._is_alive(name, pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True


def apt_install(packages: list[str], timeout: float = 600.0) -> None:
    """Install Debian `packages` with apt-get (after `apt-get update`); needs root."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ClusterError(f"cannot install {' '.join(packages)}: needs root and apt-get; "
                           f"install them by hand")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s") from None
        if done.returncode != 0:
            raise ClusterError(f"`{' '.join(cmd)}` failed: {_last_line(done.stderr)}")


def ensure_installed(timeout: float = 600.0) -> None:
    """Install Debian's slurm-wlm and munge unless `slurmctld` and `munged` are already there."""
    if _which("slurmctld") and _which("munged"):
        return
    apt_install(["slurm-wlm", "munge"], timeout=timeout)
    if not (_which("slurmctld") and _which("munged")):
        raise ClusterError("apt-get installed slurm-wlm and munge, but slurmctld/munged are still "
                           "not found in PATH or /usr/sbin")


def start_cluster(root: str | Path, timeout: float = 60.0, outlive_caller: bool = False
                  ) -> LocalCluster:
    """Install Slurm if needed, start munged, slurmctld and two slurmd under `root`, wait until
    both nodes are idle and return the running cluster (call `teardown()` to stop it). The
    daemons die with the calling process unless `outlive_caller` (the command line's `up`)."""
    ensure_installed()
    root = Path(root).resolve()
    if (root / "pids.json").is_file() and LocalCluster.from_dir(root).running():
        raise ClusterError(f"a local cluster is already running in {root}; "
                           f"stop it with `down {root}`")
    host = socket.gethostname().split(".")[0]
    nodes = (host, "localhost")
    for name in nodes:
        try:
            socket.gethostbyname(name)
        except OSError:
            raise ClusterError(f"node name {name!r} does not resolve; "
                               f"add it to /etc/hosts") from None
    for sub in ("log", "run", "state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    munge_socket = _prepare_munge(root)
    ctld_port, *node_ports = _free_ports(1 + len(nodes))
    (root / "slurm.conf").write_text(_slurm_conf(root, munge_socket, ctld_port, nodes, node_ports))

    cluster = LocalCluster(root=root, nodes=nodes, pids={})
    conf = str(cluster.conf)
    try:
        _spawn(cluster, "munged", [_which("munged"), "--foreground", f"--socket={munge_socket}",
                                   f"--key-file={root / 'munge/munge.key'}",
                                   f"--pid-file={root / 'run/munged.pid'}",
                                   f"--seed-file={root / 'munge/munged.seed'}",
                                   f"--log-file={root / 'log/munged.log'}"], outlive_caller)
        _wait_for(cluster, lambda: _munge_works(munge_socket), timeout, "munged to answer")
        # -c: start from a clean state, so a reused folder does not resurrect old jobs.
        _spawn(cluster, "slurmctld", [_which("slurmctld"), "-D", "-c", "-f", conf], outlive_caller)
        _wait_for(cluster, lambda: "UP" in _run_quiet(["scontrol", "ping"], cluster.env, 10),
                  timeout, "slurmctld to answer `scontrol ping`")
        for name in nodes:
            _spawn(cluster, f"slurmd-{name}", [_which("slurmd"), "-D", "-f", conf, "-N", name],
                   outlive_caller)
        _wait_for(cluster, lambda: set(_idle_nodes(cluster.env)) == set(nodes), timeout,
                  f"nodes {', '.join(nodes)} to be idle in sinfo")
    except BaseException:
        cluster.teardown()
        raise
    return cluster


def munge_socket_path(root: Path) -> Path:
    """Where the cluster in `root` keeps its munge socket.

    munged insists that every folder above its socket is world-executable and a socket path must
    stay under 108 bytes, so the socket lives in a short folder under /tmp named after `root`.
    """
    digest = hashlib.sha1(str(root).encode()).hexdigest()[:12]
    return Path("/tmp") / f"localcluster-munge-{digest}" / "munge.socket"


def _prepare_munge(root: Path) -> Path:
    """Create the munge key (once) and folders with the permissions munged insists on."""
    key_dir = root / "munge"
    key_dir.mkdir(parents=True, exist_ok=True)
    key_dir.chmod(0o700)
    munge_socket = munge_socket_path(root)
    munge_socket.parent.mkdir(exist_ok=True)
    munge_socket.parent.chmod(0o755)
    key = key_dir / "munge.key"
    if not key.is_file():
        done = subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise ClusterError(f"mungekey failed: {_last_line(done.stderr)}")
    return munge_socket


def _slurm_conf(root: Path, munge_socket: Path, ctld_port: int, nodes: tuple[str, ...],
                node_ports: list[int]) -> str:
    """slurm.conf text: one controller and one node line per node, all on 127.0.0.1."""
    host = nodes[0]
    cpus = max(1, (os.cpu_count() or 1) // len(nodes))
    mem_mb = max(256, _total_memory_mb() // len(nodes))
    node_lines = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN"
        for name, port in zip(nodes, node_ports))
    return f"""\
# Written by tests/e2e/local_cluster.py: a two-node test cluster on one machine.
ClusterName=localcluster
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s); keep it short for tests.
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
# Run the periodic scheduler every second, so that requeued jobs start again promptly.
SchedulerParameters=sched_interval=1,bf_interval=1
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _dies_with(parent: int) -> Callable[[], None]:
    """For `preexec_fn`: the child gets SIGTERM when `parent` exits (prctl PR_SET_PDEATHSIG),
    and exits at once if `parent` is already gone."""
    def arrange() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)
    return arrange


_PR_SET_PDEATHSIG = 1


def _spawn(cluster: LocalCluster, name: str, cmd: list[str], outlive_caller: bool) -> None:
    """Start one daemon in the foreground, in its own session, tied to this process's life
    (`_dies_with`) unless `outlive_caller`, and record its pid."""
    log = open(cluster.root / "log" / f"{name}.stdout", "ab")
    with log:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=None if outlive_caller else _dies_with(os.getpid()))
    cluster._children[name] = child
    cluster.pids[name] = child.pid
    record = {"nodes": list(cluster.nodes), "pids": cluster.pids}
    (cluster.root / "pids.json").write_text(json.dumps(record, indent=1) + "\n")


def _wait_for(cluster: LocalCluster, ready, timeout: float, what: str) -> None:
    """Poll `ready()` until true; raise with the daemon's log tail if one dies or time runs out."""
    deadline = time.monotonic() + timeout
    while not ready():
        alive = cluster.running()
        dead = [name for name in cluster.pids if name not in alive]
        if dead:
            raise ClusterError(f"{dead[0]} exited while waiting for {what}: "
                               f"{_log_tail(cluster.root, dead[0])}")
        if time.monotonic() > deadline:
            newest = list(cluster.pids)[-1]
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}: "
                               f"{_log_tail(cluster.root, newest)}")
        time.sleep(_POLL_S)


def _log_tail(root: Path, name: str, lines: int = 4) -> str:
    """The last lines a daemon wrote to its log file and to its stdout/stderr."""
    tail = []
    for path in (root / "log" / f"{name}.log", root / "log" / f"{name}.stdout"):
        if path.is_file():
            last = path.read_text(errors="replace").splitlines()[-lines:]
            tail += [f"{path.name}: {line}" for line in last]
    return " | ".join(tail) or "(no log output)"


def _munge_works(munge_socket: Path) -> bool:
    if not munge_socket.exists():
        return False
    cred = subprocess.run([_which("munge"), "-S", str(munge_socket), "-n"], capture_output=True,
                          timeout=10)
    if cred.returncode != 0:
        return False
    check = subprocess.run([_which("unmunge"), "-S", str(munge_socket)], input=cred.stdout,
                           capture_output=True, timeout=10)
    return check.returncode == 0


def _idle_nodes(env: dict[str, str]) -> list[str]:
    return _run_quiet(["sinfo", "--noheader", "--Node", "--states=idle", "--format=%N"], env,
                      timeout=10).split()


def _run_quiet(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    """stdout of a Slurm client command, or "" when it fails or hangs (used for polling)."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout if done.returncode == 0 else ""


def _free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that are free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _pid_alive(pid: int) -> bool:
    """True if `pid` runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _signal(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to `pid`; a process that has just exited is no error."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop_order(name: str) -> int:
    return 0 if name.startswith("slurmd") else 1 if name == "slurmctld" else 2


def _total_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


def _which(program: str) -> str:
    return shutil.which(program, path=_SEARCH_PATH) or ""


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    """`up DIR` starts a cluster in DIR and prints how to use it; `down DIR` stops it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("dir", type=Path,
                        help="folder holding the cluster's config, state and logs")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for daemons")
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            cluster = start_cluster(args.dir, timeout=args.timeout, outlive_caller=True)
            print(f"nodes {' '.join(cluster.nodes)} idle; logs in {cluster.root / 'log'}")
            print(f"export SLURM_CONF={cluster.conf}")
        else:
            LocalCluster.from_dir(args.dir).teardown(timeout=args.timeout)
            print(f"stopped the local cluster in {Path(args.dir).resolve()}")
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
