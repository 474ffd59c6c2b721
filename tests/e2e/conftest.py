"""Shared end-to-end fixtures: the default corpus and one real two-node Slurm cluster per test
session."""
from __future__ import annotations

from pathlib import Path

import pytest
from slurm_helpers import local_cluster


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """The default corpus and its tokenizer, built once for every run of this session."""
    from megamoe.train.corpus import ensure_default_dataset

    cache = tmp_path_factory.mktemp("megamoe-cache")
    ensure_default_dataset(cache, progress=False)
    return cache


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
