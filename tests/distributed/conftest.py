"""Shared multi-process runs: one spawn per world size, read by every test that needs it.

Starting ranks costs most of the time here, so each world size runs once per session: world
size 2 trains and saves the checkpoints that world sizes 1 and 4 then load. Ranks are forked from
a forkserver that has imported torch, Megatron-Core and megamoe's modules once
(`start_from_forkserver` with the warm launcher's PRELOAD), not spawned to import them again.
"""
import pytest

import ep_workers
from megamoe.parallel.spawn import spawn_ranks as spawn
from megamoe.parallel.spawn import start_from_forkserver
from warm_launcher import PRELOAD

start_from_forkserver(PRELOAD)

RUN_TIMEOUT_S = 900  # a whole world-size run, start-up included, on 2 busy cores


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ep_checkpoints"))


def _run(world_size, parts, ckpt_dir, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp(f"ep_world{world_size}"))
    return spawn(world_size, ep_workers.ep_job, out_dir, RUN_TIMEOUT_S, parts=parts,
                 ckpt_dir=ckpt_dir)


@pytest.fixture(scope="session")
def world2(ckpt_dir, tmp_path_factory):
    """EP=2 x DP=2 on 2 processes: layer checks, checkpoint saves, and the parallel layouts
    MegatronMoELayer rejects (GPT training at every layout: test_layouts.py)."""
    return _run(2, ["layers", "save", "rejects"], ckpt_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def world1(world2, ckpt_dir, tmp_path_factory):
    """EP=1 on 1 process: loads of the EP=2 checkpoints."""
    return _run(1, ["load"], ckpt_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def world4(world2, ckpt_dir, tmp_path_factory):
    """EP=4 on 4 processes: layer checks and loads of the EP=2 checkpoints."""
    return _run(4, ["layers", "load"], ckpt_dir, tmp_path_factory)
