"""A full disk during a save: Megatron-Core's torch_dist writer gets ENOSPC half-way through the
second checkpoint's data file (its `_write_item` writes part of the bytes, then fails as a full
filesystem does). The run stops with one line, exit code 2; the partial folder is gone, the
tracker still names the first checkpoint, which verifies, and a rerun resumes from it."""
from __future__ import annotations

import sys
import textwrap

from ckpt_fault_helpers import SMALL_RUN, TINY, assert_one_line_error, run, train

from megamoe.train.checkpoint import checkpoint_problem


_FULL_DISK_DRIVER = textwrap.dedent("""
    import errno, functools, sys
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megamoe.train.__main__ import main

    honest = filesystem_async._write_item

    @functools.wraps(honest)
    def write_until_full(*args, **kwargs):
        stream = args[-4] if len(args) >= 4 else kwargs["stream"]
        if "iter_0000002" in str(getattr(stream, "name", "")):
            stream.write(b"\\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return honest(*args, **kwargs)

    filesystem_async._write_item = write_until_full
    main(sys.argv[1:])
""")


def test_full_disk_keeps_the_previous_checkpoint(corpus_cache, tmp_path):
    out = tmp_path / "run"
    args = ["--config", str(TINY), f"output_dir={out}", f"data.cache_dir={corpus_cache}",
            *SMALL_RUN, "training.train_steps=2"]
    done = run([sys.executable, "-c", _FULL_DISK_DRIVER, *args])
    assert_one_line_error(done, "cannot write checkpoint", "the disk is full",
                          "iter_0000001 is intact")
    ckpts = out / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith((".", "iter"))) == [
        "iter_0000001"]
    assert checkpoint_problem(ckpts / "iter_0000001") is None
    resumed = train(corpus_cache, out, "training.train_steps=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 1," in resumed.stdout
