"""Checkpoint history is what the run says, through `python -m megamoe.train` and on the committed
checkpoints (tests/fixtures/mcore_checkpoints):

- a run rewound the Megatron-LM way (the tracker set back to an earlier step, a lower learning
  rate) resumes from the tracker's step and, reaching a step whose folder is left from the
  abandoned trajectory, replaces it with what it trained and says so (never "saved" for a save
  that did not happen); the tracker advances;
- a common state with megamoe's keys but a malformed format_version, train_state or layout is a
  corrupt megamoe checkpoint (one line), never read as Megatron-LM's (which would skip the
  compatibility checks), and its recorded step must be its folder's;
- two runs sharing one `checkpoint.dir` outside their output directories: the second is refused
  in one line before training, and writes nothing.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from ckpt_fault_helpers import (REPO, SMALL_RUN, TINY, assert_one_line_error, env, train,
                                trained_run)
from run_harness import step_records, wait_for

from megamoe.checkpointing.manifest import write_manifest
from megamoe.checkpointing.safe_dcp import load_common_state
from megamoe.errors import CheckpointError
from megamoe.train.checkpoint import checkpoint_problem, interpret_common_state
from megamoe.train.config import load_config

__all__ = ["trained_run"]  # fixture

TRACKER = "latest_checkpointed_iteration.txt"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "mcore_checkpoints"
FOLDERS = sorted(FIXTURES.glob("mcore-*/checkpoints/iter_*"))  # step 4 of the fixture config


def _copy(trained_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    return out


def _digests(folder: Path) -> dict[str, int]:
    return {p.name: zlib.crc32(p.read_bytes()) for p in folder.iterdir() if p.is_file()}


def _snapshot(out: Path) -> dict:
    """Every file under the run with its size and mtime: 'nothing written' compares these."""
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in out.rglob("*") if p.is_file()}


# ---- a rewound run saves what it trained ----------------------------------------------------

def test_a_rewound_run_replaces_the_abandoned_checkpoints(corpus_cache, trained_run, tmp_path):
    """The trained run (iter_1..3, tracker 3) rewound to step 1 and rerun at a lower learning
    rate: it resumes at step 1, retrains steps 2-3 and replaces iter_2 and iter_3 with them."""
    out = _copy(trained_run, tmp_path)
    ckpts = out / "checkpoints"
    (ckpts / TRACKER).write_text("1\n")
    before = {step: _digests(ckpts / f"iter_000000{step}") for step in (2, 3)}
    records_before = len((out / "metrics.jsonl").read_text().splitlines())
    done = train(corpus_cache, out, "optimizer.lr=1e-3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(step 1, 8 samples consumed)" in done.stdout  # the tracker's step
    assert "abandoned" in done.stderr and "iter_0000002" in done.stderr
    assert "saved checkpoint" not in done.stdout, done.stdout[-2000:]
    for step in (2, 3):
        folder = ckpts / f"iter_000000{step}"
        assert f"replaced checkpoint {folder}" in done.stdout, done.stdout[-2000:]
        after = _digests(folder)
        distcp = [name for name in after if name.endswith(".distcp")]
        assert distcp and all(after[name] != before[step][name] for name in distcp), step
        assert checkpoint_problem(folder) is None
        common = load_common_state(folder)
        assert common["train_state"] == {"iteration": step, "consumed_samples": 8 * step}
        assert common["config"]["optimizer"]["lr"] == pytest.approx(1e-3)  # the new trajectory
    assert (ckpts / TRACKER).read_text().strip() == "3"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", TRACKER]  # nothing left aside
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) > records_before and sorted(step_records(out)) == [1, 2, 3]


def test_keep_last_prunes_only_up_to_the_step_just_saved(tmp_path):
    """Rewound to step 1 with keep_last=1, the save of step 2 keeps iter_2, the folder the
    tracker now names (counting the abandoned iter_3 and iter_4 as newer would prune it), and
    leaves those two to be replaced when the run reaches them; iter_1 is the protected pre-run
    checkpoint."""
    from megamoe.train.checkpoint import _prune

    for step in (1, 2, 3, 4):
        (tmp_path / f"iter_000000{step}").mkdir()
    _prune(tmp_path, 1, tmp_path / "iter_0000001", 2, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004"]
    _prune(tmp_path, 1, None, 3, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004"]


def test_keep_last_keeps_the_checkpoint_whose_tokenizer_the_run_reads(tmp_path):
    """`data.tokenizer=<ckpt>/iter_2/tokenizer` with keep_last=1: iter_2 stays, the others go."""
    from megamoe.train.checkpoint import _prune

    for step in (1, 2, 3):
        (tmp_path / f"iter_000000{step}" / "tokenizer").mkdir(parents=True)
    _prune(tmp_path, 1, None, 3, str(tmp_path / "iter_0000002" / "tokenizer"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000003"]


# ---- metadata trusted only when well-typed --------------------------------------------------

def _config():
    data = FIXTURES / "data" / "synthetic"
    return load_config(str(FIXTURES / "config.yaml"),
                       [f"data.prefixes=[{data}]", f"data.tokenizer_model={data}.model"])


def _refused(common: dict, folder: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as raised:
        interpret_common_state(common, _config(), folder)
    text = str(raised.value)
    assert "\n" not in text and "corrupt" in text, text
    for fragment in fragments:
        assert fragment in text, text
    return text


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.parts[-3])
@pytest.mark.parametrize("version", ["99", "1", True, 1.0, None])
def test_a_malformed_format_version_is_a_corrupt_megamoe_checkpoint(folder, version):
    """megamoe's common state also carries Megatron-LM's keys (args, checkpoint_version,
    iteration); a format_version of the wrong type must not make it read as Megatron-LM's."""
    common = load_common_state(folder)
    assert isinstance(common.get("args"), argparse.Namespace)  # Megatron-LM's keys are there
    if version is None:
        del common["format_version"]
    else:
        common["format_version"] = version
    _refused(common, folder, "format_version", repr(version))


@pytest.mark.parametrize("damage, fragment", [
    ({"iteration": 10 ** 30, "consumed_samples": 32}, f"train_state.iteration={10 ** 30}"),
    ({"iteration": 1, "consumed_samples": 32}, "train_state.iteration=1 but the folder is step 4"),
    ({"iteration": True, "consumed_samples": 32}, "train_state.iteration=True is not a count"),
    ({"iteration": "4", "consumed_samples": 32}, "train_state.iteration='4' is not a count"),
    ({"iteration": 4, "consumed_samples": -8}, "train_state.consumed_samples=-8"),
    ({"iteration": 4}, "train_state {'iteration': 4} is not"),
    ([4, 32], "train_state [4, 32] is not"),
])
def test_a_malformed_train_state_is_refused(damage, fragment):
    folder = FOLDERS[0]
    common = load_common_state(folder)
    common["train_state"] = damage
    _refused(common, folder, fragment)


def test_a_malformed_layout_or_position_copy_is_refused():
    folder = FOLDERS[0]
    common = load_common_state(folder)
    _refused({**common, "layout": {**common["layout"], "tensor": "1"}}, folder, "layout")
    _refused({**common, "layout": None}, folder, "layout")
    _refused({**common, "iteration": 5}, folder, "iteration=5 but the folder is step 4")
    _refused({**common, "config": "x"}, folder, "has no model settings")


def test_megatron_lm_is_recognised_by_its_own_keys():
    """Without megamoe's keys, Megatron-LM's args + checkpoint_version + iteration read as a
    Megatron-LM checkpoint (position only, its step checked against the folder's); without
    Megatron-LM's either, the state is neither."""
    folder = FOLDERS[0]
    common = load_common_state(folder)
    megatron_lm = {key: common[key] for key in ("args", "checkpoint_version", "iteration")}
    state, layout = interpret_common_state(megatron_lm, _config(), folder)
    assert (state.iteration, layout) == (4, None)
    with pytest.raises(CheckpointError, match="iteration=3 but the folder is step 4"):
        interpret_common_state({**megatron_lm, "iteration": 3}, _config(), folder)
    without_version = {k: v for k, v in megatron_lm.items() if k != "checkpoint_version"}
    with pytest.raises(CheckpointError, match="neither a megamoe nor a Megatron-LM"):
        interpret_common_state(without_version, _config(), folder)


def _planted(trained_run: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the trained run whose newest checkpoint's common state has `changes`, written
    to common.pt (read before the .distcp copy of megatron-core >= 0.19) with a new manifest, as
    a careless edit would leave it."""
    out = _copy(trained_run, tmp_path)
    folder = out / "checkpoints" / "iter_0000003"
    torch.save({**load_common_state(folder), **changes}, folder / "common.pt")
    write_manifest(folder)
    return out


@pytest.mark.parametrize("changes, overrides, fragments", [
    # the case: a top-1 resume of a top-2 checkpoint ran as a Megatron-LM one
    ({"format_version": "1"}, ("moe.topk=1",), ("format_version '1' (str)",)),
    ({"train_state": {"iteration": 10 ** 30, "consumed_samples": 24}}, (),
     (f"train_state.iteration={10 ** 30}", "folder is step 3")),
], ids=["format_version", "train_state"])
def test_malformed_metadata_stops_the_trainer_in_one_line(changes, overrides, fragments,
                                                          corpus_cache, trained_run, tmp_path):
    out = _planted(trained_run, tmp_path, **changes)
    before = _snapshot(out)
    done = train(corpus_cache, out, "training.train_steps=5", *overrides)
    assert_one_line_error(done, "iter_0000003", "corrupt", *fragments)
    assert _snapshot(out) == before


# ---- one checkpoint folder per run ---------------------------------------------------------

def test_a_second_run_on_a_shared_checkpoint_dir_is_refused(corpus_cache, tmp_path):
    shared = tmp_path / "shared_ckpts"
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    command = [sys.executable, "-m", "megamoe.train", "--config", str(TINY),
               f"output_dir={first_out}", f"data.cache_dir={corpus_cache}", *SMALL_RUN,
               "training.train_steps=100000", "checkpoint.interval=0", f"checkpoint.dir={shared}"]
    first = subprocess.Popen(command, cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: (first_out / "metrics.jsonl").is_file(), 180, first), \
            "the first run did not start training"
        second = train(corpus_cache, second_out, f"checkpoint.dir={shared}")
        assert_one_line_error(second, f"checkpoint.dir {shared} is in use by another run",
                              f"pid {first.pid}")
        assert not second_out.exists()  # nothing written, not even its output directory
        assert sorted(p.name for p in shared.iterdir()) == []  # and nothing in the shared one
    finally:
        first.kill()
        first.wait(timeout=60)
