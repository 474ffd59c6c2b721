"""SLURM launch mechanics on a real two-node Slurm cluster running on this machine.

The cluster (tests/e2e/local_cluster.py, the `cluster` fixture of conftest.py) is started once per
test session and skipped, with the reason,
where Slurm cannot be installed. A throwaway batch script proves what launch/pretrain_moe.sh relies
on: `srun` starts one task per node, and torchrun agents on both nodes meet in a c10d rendezvous
hosted on the first node of the allocation, then their workers all-reduce over gloo.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

import local_cluster
import warm_launcher
from slurm_helpers import PRETRAIN_SCRIPT

# One torchrun per node, rendezvous on the allocation's first node, exactly as pretrain_moe.sh does.
RENDEZVOUS_JOB = """\
#!/bin/bash
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "head node: $head_node"
srun --ntasks-per-node=1 --label \\
    "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node=1 \\
        --rdzv-backend=c10d --rdzv-endpoint="$head_node:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \\
        allreduce.py
"""

ALLREDUCE = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {os.environ['SLURMD_NODENAME']}"
      f" sum {value.item()}", flush=True)
dist.destroy_process_group()
"""


def test_rendezvous_spans_both_nodes(cluster, tmp_path):
    (tmp_path / "job.sh").write_text(RENDEZVOUS_JOB)
    (tmp_path / "allreduce.py").write_text(ALLREDUCE)
    log = tmp_path / "job.out"
    env = {"PYTHON": sys.executable, "RDZV_PORT": str(warm_launcher.free_port())}
    result = cluster.run_job(tmp_path / "job.sh", sbatch_args=["--nodes=2", f"--output={log}"],
                             cwd=tmp_path, env=env, timeout=180)
    text = log.read_text()
    assert result.state == "COMPLETED", f"job ended {result.state} ({result.exit_code}):\n{text}"

    workers = re.findall(r"^(\d+): rank (\d+) of (\d+) on (\S+) sum (\S+)$", text, re.MULTILINE)
    assert len(workers) == 2, text
    assert {task for task, *_ in workers} == {"0", "1"}          # one srun task per node
    assert {rank for _, rank, *_ in workers} == {"0", "1"}
    assert {world for _, _, world, *_ in workers} == {"2"}
    assert {node for *_, node, _ in workers} == set(cluster.nodes)  # both nodes took part
    assert {float(total) for *_, total in workers} == {1.0 + 2.0}   # ranks contribute rank + 1


def test_pretrain_script_parses():
    subprocess.run(["bash", "-n", str(PRETRAIN_SCRIPT)], check=True, timeout=30)


def test_pretrain_script_passes_shellcheck():
    if not shutil.which("shellcheck"):
        try:
            local_cluster.apt_install(["shellcheck"], timeout=300)
        except local_cluster.ClusterError as err:
            pytest.skip(f"shellcheck not available: {err}")
    done = subprocess.run(["shellcheck", str(PRETRAIN_SCRIPT)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("slurm_env, args, message", [
    ({}, ["configs/x.yaml"], "submit this script with sbatch"),
    ({"SLURM_JOB_ID": "1"}, [], "no config given"),
])
def test_pretrain_script_refuses_bad_use(slurm_env, args, message, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("CONFIG", raising=False)
    for key, value in slurm_env.items():
        monkeypatch.setenv(key, value)
    done = subprocess.run(["bash", str(PRETRAIN_SCRIPT), *args], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2
    assert message in done.stderr and done.stdout == ""


def _fake_slurm(tmp_path) -> dict:
    """An environment whose `scontrol` names one node and whose `srun` records its arguments
    (one a line) in tmp_path/srun.args instead of starting anything."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    (bin_dir / "srun").write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {tmp_path}/srun.args\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "1234",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1", "HOME": str(tmp_path)}


@pytest.mark.parametrize("name, value", [
    ("NPROC_PER_NODE", "$(touch {marker})"), ("NPROC_PER_NODE", "a[$(touch {marker})]"),
    ("NPROC_PER_NODE", "0"), ("NPROC_PER_NODE", "-4"), ("NPROC_PER_NODE", "010"),
    ("SLURM_JOB_ID", "x[$(touch {marker})]"), ("SLURM_CPUS_PER_TASK", "0"),
    ("RDZV_PORT", "70000"), ("SLURM_GPUS_ON_NODE", "1+1"),
])
def test_pretrain_script_refuses_a_number_that_is_not_one(name, value, tmp_path):
    """A numeric variable that is not a plain integer in range is one line, exit 2, before bash
    arithmetic evaluates it (a command substitution inside it never runs) and before srun."""
    marker = tmp_path / "ran"
    env = {**_fake_slurm(tmp_path), name: value.format(marker=marker)}
    done = subprocess.run(["bash", str(PRETRAIN_SCRIPT), "configs/x.yaml"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {name}=") and len(done.stderr.splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "srun.args").exists()


def test_pretrain_script_passes_valid_numbers_to_torchrun(tmp_path):
    env = {**_fake_slurm(tmp_path), "NPROC_PER_NODE": "3", "SLURM_CPUS_PER_TASK": "6"}
    done = subprocess.run(["bash", str(PRETRAIN_SCRIPT), "configs/x.yaml"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert "--nproc-per-node=3" in args and "--cpus-per-task=6" in args
    assert "--rdzv-endpoint=node1:21234" in args  # 20000 + job id 1234 % 10000
