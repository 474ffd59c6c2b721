"""The tokenizer a training checkpoint records (issue 45: one tokenizer identity through data,
checkpoints and export).

Every checkpoint a run saves holds, beside its tensors:
- in its common state, under `checkpoint_schema.TOKENIZER_KEY`, the identity of the run's
  tokenizer (`tokenizer_record`: `megamoe.train.tokenizer.identity` and the path it was loaded
  from);
- the tokenizer's files in `CHECKPOINT_TOKENIZER_DIR` (so tools/export_hf.py ships the
  tokenizer the model was trained with, without being told), and `HF_SOURCE_DIR`, the source
  model's Hugging Face configs kept by tools/import_hf.py, carried over from the checkpoint the
  run started from.
Both folders are written into the checkpoint's temporary folder before its manifest, so they
are checksummed and appear with the checkpoint, atomically.

Starting from a checkpoint (`checkpoint.init_from` or resuming) whose recorded tokenizer is not
the run's is refused (`check_checkpoint_tokenizer`) unless `checkpoint.allow_other_tokenizer`.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Iterable, Optional

from megamoe.errors import CheckpointError
from megamoe.train.checkpoint_schema import saved_tokenizer
from megamoe.train.config import TrainConfig
from megamoe.train.tokenizer import Tokenizer, copy_tokenizer, describe_identity, identity

CHECKPOINT_TOKENIZER_DIR = "tokenizer"
"""The tokenizer's files inside a checkpoint folder (`iter_N/tokenizer/`, `release/tokenizer/`)."""
HF_SOURCE_DIR = "hf_source"
"""The source model's config.json and generation_config.json inside a checkpoint folder."""


def tokenizer_record(tokenizer: Tokenizer) -> dict:
    """What a checkpoint's common state records of `tokenizer`."""
    return {**identity(tokenizer), "source": str(tokenizer.path)}


def write_checkpoint_files(folder: Path, tokenizer: Optional[Tokenizer],
                           origins: Iterable[Optional[Path]]) -> None:
    """Copy `tokenizer` into `folder`/tokenizer and the first `hf_source/` of `origins` (the
    checkpoints the run started from, newest first) into `folder`/hf_source."""
    if tokenizer is not None:
        copy_tokenizer(tokenizer, folder / CHECKPOINT_TOKENIZER_DIR)
    for origin in origins:
        if origin is not None and (origin / HF_SOURCE_DIR).is_dir():
            shutil.copytree(origin / HF_SOURCE_DIR, folder / HF_SOURCE_DIR, symlinks=True)
            return


def check_checkpoint_tokenizer(common: dict, path: Path, tokenizer: Optional[Tokenizer],
                               config: TrainConfig, rank0: bool = True) -> None:
    """Refuse (one-line CheckpointError) to train the weights of checkpoint `path` (common state
    `common`) on data of `tokenizer` when the checkpoint records another tokenizer; with
    `checkpoint.allow_other_tokenizer` warn instead (on `rank0`). A checkpoint recording none
    (older ones, Megatron-LM's) or a run without a tokenizer passes."""
    record = saved_tokenizer(common, path)
    if record is None or tokenizer is None or record["fingerprint"] == tokenizer.fingerprint:
        return
    what = (f"checkpoint {path} was trained with tokenizer {describe_identity(record)} but this "
            f"run's data is tokenized with {tokenizer.describe()}")
    if config.checkpoint.allow_other_tokenizer:
        if rank0:
            print(f"warning: {what}; training it anyway (checkpoint.allow_other_tokenizer=true)",
                  file=sys.stderr, flush=True)
        return
    own = path / CHECKPOINT_TOKENIZER_DIR
    use = f"data.tokenizer={own}" if own.is_dir() else "data.tokenizer=<its tokenizer>"
    raise CheckpointError(f"{what}; train it on data of its own tokenizer ({use}, and data "
                          "made with it by tools/preprocess_data.py), or set "
                          "checkpoint.allow_other_tokenizer=true if the change is intended")
