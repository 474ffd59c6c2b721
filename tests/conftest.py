"""Test-wide settings and fixtures.

Megatron's torch.compile-based jit fuser costs seconds per first call on CPU, so TorchDynamo is
off for every test.
"""
import os
from pathlib import Path

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """The default corpus and its tokenizer, built once per test session for every suite."""
    from megamoe.train.corpus import ensure_default_dataset

    cache = tmp_path_factory.getbasetemp() / "megamoe-corpus"
    ensure_default_dataset(cache, progress=False)
    return cache
