"""Fuzzed checkpoint metadata and corrupted data files, in-process (hypothesis; few examples
under CI=true): the tracker file, the manifest, `.metadata`, `common.pt` content and indexed
datasets damaged at random offsets either load or raise the package's one-line error types,
never anything else."""
from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_fault_helpers import QUICK, REPO, TINY, assert_one_line_error, env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megamoe.checkpointing.layout import latest_checkpoint
from megamoe.checkpointing.manifest import MANIFEST_FILE, verify_folder, write_manifest
from megamoe.checkpointing.safe_dcp import load_common_state, read_dcp_metadata
from megamoe.errors import CheckpointError, DataError
from megamoe.train.checkpoint import interpret_common_state
from megamoe.train.config import load_config
from megamoe.train.indexed_check import check_indexed_dataset
import warm_launcher

FUZZ = settings(max_examples=15 if QUICK else 60, deadline=None, derandomize=QUICK,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) |
                    st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) |
                    st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)


@FUZZ
@given(content=st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
def test_tracker_file_content(content, tmp_path_factory):
    root = tmp_path_factory.mktemp("tracker")
    (root / "iter_0000003").mkdir()
    (root / "latest_checkpointed_iteration.txt").write_bytes(content)
    try:
        found = latest_checkpoint(root)
    except CheckpointError as err:
        assert "\n" not in str(err)
        return
    assert found == root / "iter_0000003"


def _folder(root: Path) -> Path:
    folder = root / "ckpt"
    folder.mkdir()
    (folder / "a.distcp").write_bytes(bytes(range(256)) * 8)
    (folder / "common.pt").write_bytes(b"x" * 100)
    write_manifest(folder)
    return folder


@FUZZ
@given(manifest=JSON.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=200),
       keep_format=st.booleans())
def test_manifest_content(manifest, keep_format, tmp_path_factory):
    folder = _folder(tmp_path_factory.mktemp("manifest"))
    if keep_format:
        honest = json.loads((folder / MANIFEST_FILE).read_text())
        try:
            honest["files"] = json.loads(manifest)
        except (ValueError, UnicodeDecodeError):
            pass
        manifest = json.dumps(honest).encode()
    (folder / MANIFEST_FILE).write_bytes(manifest)
    problem = verify_folder(folder)
    assert problem is None or (isinstance(problem, str) and "\n" not in problem)


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 64))
def test_corrupted_metadata_file(seed, count, tmp_path_factory):
    """Real DCP metadata with bytes flipped at a random offset."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    folder = tmp_path_factory.mktemp("dcp")
    save({"w": torch.arange(6.0), "b": io.BytesIO(b"abc")}, storage_writer=FileSystemWriter(
        folder), no_dist=True)
    data = bytearray((folder / ".metadata").read_bytes())
    rng = random.Random(seed)
    offset = rng.randrange(len(data))
    for i in range(offset, min(len(data), offset + count)):
        data[i] ^= rng.randrange(1, 256)
    (folder / ".metadata").write_bytes(bytes(data))
    try:
        read_dcp_metadata(folder / ".metadata")
    except CheckpointError as err:
        assert "\n" not in str(err)


def _common(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


COMMON = st.fixed_dictionaries({}, optional={
    "format_version": st.sampled_from([1, 2, None, "1"]),
    "config": JSON, "train_state": JSON, "layout": JSON,
    "iteration": st.integers(-3, 10) | st.text(max_size=3),
    "args": st.builds(argparse.Namespace, num_layers=st.integers(0, 8),
                      hidden_size=st.sampled_from([64, 128]),
                      consumed_train_samples=st.integers(-2, 50) | st.none()),
})


@FUZZ
@given(common=COMMON, raw=st.booleans(), junk=st.binary(max_size=64))
def test_common_state_content(common, raw, junk, tmp_path_factory):
    """Any common.pt (garbage bytes, or a dict of fuzzed keys) gives a position or one line."""
    folder = tmp_path_factory.mktemp("common")
    (folder / "common.pt").write_bytes(junk if raw else _common(common))
    config = load_config(TINY, ["parallel.expert=1"])
    try:
        state, _ = interpret_common_state(load_common_state(folder), config, folder)
    except CheckpointError as err:
        assert "\n" not in str(err)
        return
    assert state.iteration >= 0 and state.consumed_samples >= 0


# ---- data files -----------------------------------------------------------------------------

def _dataset(root: Path, documents: int = 20) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(root / "docs")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        builder.add_item(torch.from_numpy(rng.integers(0, 1000, rng.integers(5, 40)).astype(
            np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


@FUZZ
@given(seed=st.integers(0, 2**32 - 1))
def test_index_damaged_at_a_random_offset(seed, tmp_path_factory):
    """One byte of the header, lengths or pointers of the .idx changed: always detected."""
    prefix = _dataset(tmp_path_factory.mktemp("data"))
    idx = Path(f"{prefix}.idx")
    data = bytearray(idx.read_bytes())
    sequences = 20
    rng = random.Random(seed)
    offset = rng.randrange(0, 34 + 12 * sequences)
    data[offset] ^= rng.randrange(1, 256)
    idx.write_bytes(bytes(data))
    with pytest.raises(DataError, match="docs"):
        check_indexed_dataset(prefix, vocab_size=1000)


def test_bin_damage_and_mismatched_pairs(tmp_path):
    prefix = _dataset(tmp_path)
    check_indexed_dataset(prefix, vocab_size=1000)
    bin_ = Path(f"{prefix}.bin")
    honest = bin_.read_bytes()
    for offset in random.Random(7).sample(range(0, len(honest) - 8, 2), 5):
        damaged = bytearray(honest)
        damaged[offset:offset + 2] = b"\xff\xff"
        bin_.write_bytes(bytes(damaged))
        with pytest.raises(DataError, match="outside the tokenizer's 1000 ids"):
            check_indexed_dataset(prefix, vocab_size=1000)
    bin_.write_bytes(honest[:-6])
    with pytest.raises(DataError, match="do not belong together"):
        check_indexed_dataset(prefix, vocab_size=1000)
    (tmp_path / "other").mkdir()
    other = _dataset(tmp_path / "other", documents=25)
    shutil.copy(f"{other}.bin", bin_)
    with pytest.raises(DataError, match="do not belong together"):
        check_indexed_dataset(prefix, vocab_size=1000)


def test_mismatched_data_files_through_the_trainer(corpus_cache, tmp_path):
    """`python -m megamoe.train` on a .bin/.idx pair from different data: one line, exit 2,
    nothing written."""
    from megamoe.train.corpus import default_dataset_dir

    source = default_dataset_dir(corpus_cache, 4096)
    shutil.copy(source / "text_document.idx", tmp_path / "mixed.idx")
    data = (source / "text_document.bin").read_bytes()
    (tmp_path / "mixed.bin").write_bytes(data[: len(data) // 2])
    out = tmp_path / "run"
    done = warm_launcher.run(
        [sys.executable, "-m", "megamoe.train", "--config", str(TINY), f"output_dir={out}",
         f"data.prefixes=[{tmp_path / 'mixed'}]",
         f"data.tokenizer_model={source / 'text_document.model'}", "parallel.expert=1",
         "training.train_steps=1", "logging.progress_bar=false", "logging.tensorboard=false"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=240)
    assert_one_line_error(done, "mixed.bin", "do not belong together")
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
