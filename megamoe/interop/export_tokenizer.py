"""The tokenizer an exported Hugging Face model ships: the one its checkpoint records.

A training checkpoint, and tools/import_hf.py's or tools/upcycle_ckpt.py's output, keeps the
tokenizer its model was trained (or imported) with in its `tokenizer/` folder and that
tokenizer's identity in its common state (megamoe.train.checkpoint_tokenizer). The export takes
that folder without being told; `--tokenizer` may name the same tokenizer elsewhere, and is
refused when it is another one. Outputs of the converters from before the folder existed kept
the files in `hf_tokenizer/` beside the checkpoint, which is read as before.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megamoe.errors import CheckpointError, ConfigError
from megamoe.train.checkpoint_schema import saved_tokenizer
from megamoe.train.checkpoint_tokenizer import CHECKPOINT_TOKENIZER_DIR
from megamoe.train.tokenizer import Tokenizer, describe_identity, load_tokenizer

LEGACY_TOKENIZER_DIR = "hf_tokenizer"


def recorded_tokenizer(folder: Path, common: dict, load: Path,
                       given: Optional[str]) -> tuple[Optional[Tokenizer], Optional[dict]]:
    """(the tokenizer to ship with the export of checkpoint `folder`, the identity its common
    state `common` records): `given` (--tokenizer) when set and not another tokenizer than the
    recorded one, else the checkpoint's `tokenizer/`, else a converter's older
    `hf_tokenizer/` beside `load`; (None, record) when there is none and nothing is recorded."""
    record = saved_tokenizer(common, folder)
    own = folder / CHECKPOINT_TOKENIZER_DIR
    if given is not None:
        tokenizer = load_tokenizer(given)
        if record is not None and tokenizer.fingerprint != record["fingerprint"]:
            raise ConfigError(f"--tokenizer {tokenizer.describe()} is not the tokenizer "
                              f"{folder} was trained with ({describe_identity(record)}); leave "
                              "--tokenizer out to ship the recorded one")
        return tokenizer, record
    if own.is_dir():
        tokenizer = load_tokenizer(own)
        if record is not None and tokenizer.fingerprint != record["fingerprint"]:
            raise CheckpointError(f"{own} ({tokenizer.describe()}) is not the tokenizer the "
                                  f"checkpoint records ({describe_identity(record)}); the "
                                  "checkpoint is corrupt")
        return tokenizer, record
    if record is not None:
        raise CheckpointError(f"{folder} records tokenizer {describe_identity(record)} but holds "
                              f"no {CHECKPOINT_TOKENIZER_DIR}/ folder; pass it with --tokenizer")
    for legacy in (load / LEGACY_TOKENIZER_DIR, load.parent / LEGACY_TOKENIZER_DIR):
        if legacy.is_dir():
            return load_tokenizer(legacy), None
    return None, None


def token_ids(tokenizer: Optional[Tokenizer], record: Optional[dict]) -> dict:
    """{bos_token_id, eos_token_id, pad_token_id} of the tokenizer (None where it has none)."""
    if tokenizer is None and record is None:
        return {}
    bos = tokenizer.bos if tokenizer is not None else record["bos"]
    eod = tokenizer.eod if tokenizer is not None else record["eod"]
    pad = getattr(tokenizer, "pad", -1) if tokenizer is not None else -1
    return {"bos_token_id": bos if bos >= 0 else None, "eos_token_id": eod,
            "pad_token_id": pad if pad >= 0 else None}
