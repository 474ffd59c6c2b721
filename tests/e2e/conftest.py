"""Shared end-to-end fixtures: one real two-node Slurm cluster per test session (the corpus
fixture is the root conftest's)."""
from __future__ import annotations

import pytest
import local_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A running two-node local cluster; skipped where Slurm cannot be installed."""
    try:
        local_cluster.ensure_installed()
    except local_cluster.ClusterError as err:
        pytest.skip(f"no local Slurm cluster: {err}")
    running = local_cluster.start_cluster(tmp_path_factory.mktemp("slurm"), timeout=60)
    yield running
    running.teardown()
