"""No checkpoint file is unpickled beyond an allow-list: payloads planted in `.metadata`,
`common.pt`, a sharded object (rng_state inside a `.distcp`) and a legacy per-rank
`model_optim_rng.pt` would create a marker file if any unpickler ran them. Resume, init_from
and tools/upcycle_ckpt.py (real processes) refuse each with one line naming the file and the
type, exit code 2, and the marker never appears. The manifest is rewritten after planting, as a
deliberate attacker would, so the unpickler, not the checksum, is what stops them."""
from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_fault_helpers import (ExecPayload, Payload, SMALL_RUN, TINY, assert_one_line_error,
                                pickled, run, train, trained_run, upcycle)

from megamoe.checkpointing.manifest import write_manifest
from megamoe.errors import CheckpointError

__all__ = ["trained_run"]  # fixture


def _planted_copy(trained_run: Path, tmp_path: Path, name: str, data: bytes) -> Path:
    """A copy of the trained run whose newest checkpoint has `name` replaced by `data`."""
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    folder = out / "checkpoints" / "iter_0000003"
    (folder / name).write_bytes(data)
    write_manifest(folder)
    return out


def _all_entry_points(corpus_cache, out: Path, tmp_path: Path, marker: Path, *fragments: str):
    """Resume, init_from and the upcycler on `out`: each refuses with one line, no marker."""
    resumed = train(corpus_cache, out, "training.train_steps=4")
    assert_one_line_error(resumed, *fragments)
    started = train(corpus_cache, tmp_path / "fresh", "training.train_steps=4",
                    f"checkpoint.init_from={out / 'checkpoints'}")
    assert_one_line_error(started, *fragments)
    upcycled = upcycle(out / "checkpoints", tmp_path / "moe")
    assert_one_line_error(upcycled, *fragments)
    assert not (tmp_path / "moe").exists()
    assert not marker.exists()


def test_metadata_payload_never_runs(corpus_cache, trained_run, tmp_path):
    marker = tmp_path / "pwned"
    out = _planted_copy(trained_run, tmp_path, ".metadata", pickled(Payload(marker)))
    _all_entry_points(corpus_cache, out, tmp_path, marker, "iter_0000003/.metadata",
                      "posix.system")


@pytest.mark.parametrize("payload, type_name", [(Payload, "posix.system"),
                                                (ExecPayload, "builtins.exec")])
def test_metadata_readers_refuse_payloads(payload, type_name, tmp_path):
    """The same refusal in-process, for both DCP readers megamoe uses."""
    from megamoe.checkpointing.safe_dcp import SafeFileSystemReader, read_dcp_metadata

    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickled(payload(marker)))
    with pytest.raises(CheckpointError, match=type_name):
        read_dcp_metadata(tmp_path / ".metadata")
    with pytest.raises(CheckpointError, match=type_name):
        SafeFileSystemReader(tmp_path).read_metadata()
    assert not marker.exists()


def test_common_pt_payload_never_runs(corpus_cache, trained_run, tmp_path):
    marker = tmp_path / "pwned"
    import io
    buffer = io.BytesIO()
    torch.save({"args": Payload(marker), "iteration": 3}, buffer)
    out = _planted_copy(trained_run, tmp_path, "common.pt", buffer.getvalue())
    _all_entry_points(corpus_cache, out, tmp_path, marker, "iter_0000003/common.pt",
                      "posix.system")


_EVIL_RNG_DRIVER = textwrap.dedent("""
    import os, sys
    import megamoe.train.checkpoint as checkpoint
    from megamoe.train.__main__ import main

    class Payload:
        def __reduce__(self):
            return exec, ("open(%r, 'w').close()" % sys.argv[1],)

    honest = checkpoint._rng_state
    checkpoint._rng_state = lambda: {**honest(), "extra": Payload()}
    main(sys.argv[2:])
""")


def test_sharded_object_payload_never_runs(corpus_cache, tmp_path):
    """A run whose saved rng_state object carries a payload (saved by a patched trainer, with
    a valid manifest): resuming refuses it; the upcycler's object reader refuses it too."""
    marker, out = tmp_path / "pwned", tmp_path / "evil"
    made = run([sys.executable, "-c", _EVIL_RNG_DRIVER, str(marker), "--config", str(TINY),
                f"output_dir={out}", f"data.cache_dir={corpus_cache}", *SMALL_RUN,
                "training.train_steps=1"])
    assert made.returncode == 0, made.stderr[-3000:]
    assert not marker.exists()
    resumed = train(corpus_cache, out, "training.train_steps=2")
    assert_one_line_error(resumed, "iter_0000001", "rng_state", "builtins.exec")
    from megamoe.checkpointing.dcp_reader import DCPReader

    reader = DCPReader(out / "checkpoints" / "iter_0000001")
    key = next(k for k in reader.objects() if k.startswith("rng_state"))
    with pytest.raises(CheckpointError, match="builtins.exec"):
        reader.read_object(key)
    assert not marker.exists()


def test_legacy_rank_file_payload_never_runs(tmp_path):
    """A Megatron-LM legacy checkpoint whose rank file holds a payload next to the weights."""
    marker = tmp_path / "pwned"
    rank_dir = tmp_path / "dense" / "iter_0000005" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save({"model": {"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(4, 8)},
                "args": Payload(marker), "iteration": 5}, rank_dir / "model_optim_rng.pt")
    (tmp_path / "dense" / "latest_checkpointed_iteration.txt").write_text("5")
    done = upcycle(tmp_path / "dense", tmp_path / "moe")
    assert_one_line_error(done, "mp_rank_00/model_optim_rng.pt", "posix.system")
    assert not (tmp_path / "moe").exists()
    assert not marker.exists()


