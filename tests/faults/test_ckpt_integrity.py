"""Checkpoint integrity and bad checkpoint folders, as a user meets them through
`python -m megamoe.train`: every file is checked against the manifest before any tensor is used;
a bad checkpoint stops the run with one line naming the file and the newest checkpoint that
verifies, exit code 2, nothing written; `checkpoint.resume_from_verified=true` resumes from that
one, and `keep_last` never prunes it."""
from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import pytest
from ckpt_fault_helpers import (assert_one_line_error, run, train, trained_run,
                                upcycle)

from megamoe.checkpointing.manifest import MANIFEST_FILE

MCORE_0_16_CHECKPOINT = (Path(__file__).resolve().parents[1] / "fixtures" / "mcore_checkpoints" /
                         "mcore-0.16.1" / "checkpoints" / "iter_0000004")

__all__ = ["trained_run"]  # fixture


def _copy(trained_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    return out


def _snapshot(out: Path) -> dict:
    """Every file under the run with its size and mtime: 'nothing written' compares these."""
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in out.rglob("*") if p.is_file()}


def _flip(path: Path, seed: int, count: int = 4096) -> int:
    """XOR `count` bytes (or the whole file if smaller) at a random offset; returns it."""
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    count = min(count, len(data))
    offset = rng.randrange(0, len(data) - count + 1)
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return offset


def test_flipped_bytes_stop_the_resume_naming_the_file(corpus_cache, trained_run, tmp_path):
    """4 KiB flipped inside a .distcp of the newest checkpoint: the run does not resume from it
    and names the file and iter_0000002, the newest checkpoint that verifies."""
    out = _copy(trained_run, tmp_path)
    distcp = sorted((out / "checkpoints" / "iter_0000003").glob("*.distcp"))[0]
    _flip(distcp, seed=13)
    before = _snapshot(out)
    done = train(corpus_cache, out, "training.train_steps=4")
    assert_one_line_error(done, distcp.name, "checksum", "iter_0000002",
                          "checkpoint.resume_from_verified=true")
    assert _snapshot(out) == before


def test_resume_from_verified_and_keep_last_keeps_it(corpus_cache, trained_run, tmp_path):
    """With checkpoint.resume_from_verified=true the run resumes from iter_0000002; with
    keep_last=1 the pruning after later saves still keeps that pre-run verified checkpoint."""
    out = _copy(trained_run, tmp_path)
    (out / "checkpoints" / "iter_0000003" / "common.pt").write_bytes(b"garbage")
    done = train(corpus_cache, out, "training.train_steps=5", "checkpoint.resume_from_verified=true",
                 "checkpoint.keep_last=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "iter_0000002" in done.stderr
    assert "(step 2," in done.stdout
    left = sorted(p.name for p in (out / "checkpoints").glob("iter_*"))
    assert left == ["iter_0000002", "iter_0000005"]
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"


@pytest.mark.parametrize("damage, fragments", [
    ("truncate_distcp", ("bytes, the manifest says",)),
    ("delete_metadata", (".metadata is missing",)),
    ("corrupt_manifest", (MANIFEST_FILE,)),
    ("tracker_names_nothing", ("latest_checkpointed_iteration.txt names 'iter_0000009'",)),
    ("tracker_not_a_number", ("not an iteration number",)),
])
def test_bad_checkpoint_folder_is_one_line(damage, fragments, corpus_cache, trained_run,
                                           tmp_path):
    out = _copy(trained_run, tmp_path)
    folder = out / "checkpoints" / "iter_0000003"
    if damage == "truncate_distcp":
        path = sorted(folder.glob("*.distcp"))[0]
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "delete_metadata":
        (folder / ".metadata").unlink()
    elif damage == "corrupt_manifest":
        _flip(folder / MANIFEST_FILE, seed=5, count=40)
    elif damage == "tracker_names_nothing":
        (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("9\n")
    else:
        (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("latest?\n")
    before = _snapshot(out)
    assert_one_line_error(train(corpus_cache, out, "training.train_steps=4"), *fragments)
    assert _snapshot(out) == before


def test_folder_without_common_pt_for_init_from_and_upcycler(corpus_cache, tmp_path):
    """A torch_dist folder lacking its common state (common.pt, and no common_state object as
    megatron-core >= 0.19 writes; no manifest, as Megatron-LM writes them): a one-line error
    naming the file rather than Megatron-Core's AttributeError. The folder is the committed
    megatron-core 0.16.1 checkpoint, whose common state is common.pt, on either version."""
    folder = tmp_path / "iter_0000004"
    shutil.copytree(MCORE_0_16_CHECKPOINT, folder)
    (folder / MANIFEST_FILE).unlink()
    (folder / "common.pt").unlink()
    done = train(corpus_cache, tmp_path / "fresh", f"checkpoint.init_from={folder}")
    assert_one_line_error(done, "common.pt is missing")
    assert not (tmp_path / "fresh" / "checkpoints").exists()


def test_checkpoint_of_another_model_shape(corpus_cache, trained_run, tmp_path):
    """Resume with another hidden size, init_from with another dense-layer count (which failed
    inside Megatron-Core's loader): one line naming the setting, both values and the fix."""
    out = _copy(trained_run, tmp_path)
    done = train(corpus_cache, out, "training.train_steps=4", "model.hidden_size=64")
    assert_one_line_error(done, "model.hidden_size=128", "64")
    started = train(corpus_cache, tmp_path / "fresh", "model.first_k_dense=2",
                    f"checkpoint.init_from={out / 'checkpoints'}")
    assert_one_line_error(started, "iter_0000003", "model.first_k_dense=1",
                          "config says 2", "set model.first_k_dense=1")
    assert not (tmp_path / "fresh" / "checkpoints").exists()


def test_upcycler_refuses_a_corrupt_input(trained_run, tmp_path):
    """tools/upcycle_ckpt.py on a checkpoint with a flipped .distcp: one line, no output."""
    out = _copy(trained_run, tmp_path)
    distcp = sorted((out / "checkpoints" / "iter_0000003").glob("*.distcp"))[0]
    _flip(distcp, seed=3)
    done = upcycle(out / "checkpoints", tmp_path / "moe")
    assert_one_line_error(done, distcp.name, "checksum")
    assert not (tmp_path / "moe").exists()


def test_export_names_a_tokenizer_file_that_fails_its_checksum(trained_run, tmp_path):
    """tools/export_hf.py on a checkpoint whose tokenizer file was damaged: the checksum
    failure, named as such (not a tokenizer of the wrong format, nor advice to pass one with
    --tokenizer), exit code 2, no output."""
    out = _copy(trained_run, tmp_path)
    model = out / "checkpoints" / "iter_0000003" / "tokenizer" / "tokenizer.model"
    _flip(model, seed=5, count=64)
    done = run([sys.executable, "tools/export_hf.py", "--load", str(out / "checkpoints"),
                "--save", str(tmp_path / "hf")])
    line = assert_one_line_error(done, "tokenizer/tokenizer.model", "checksum",
                                 "restore it or use another checkpoint")
    assert "--tokenizer" not in line and "SentencePiece" not in line
    assert not (tmp_path / "hf").exists()
