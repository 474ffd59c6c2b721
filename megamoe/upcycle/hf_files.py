"""The Hugging Face files a converter carries from the source model folder into its checkpoint
folder (`OUT/release/`, inside its checksum manifest), so that training and export need nothing
but the converted output:

- `tokenizer/`: the model's own tokenizer (`megamoe.train.tokenizer.copy_tokenizer`, with the
  model's config.json, whose model_type decides transformers' tokenizer class), where training
  checkpoints keep the run's tokenizer, and its record in the checkpoint's common state, as a
  training run writes them (megamoe.train.checkpoint_tokenizer);
- `hf_source/`: the source's `config.json` and `generation_config.json`, byte for byte, and
  `SOURCE_RECORD` (what the conversion left out, e.g. dropped multi-token-prediction layers):
  tools/export_hf.py writes the exported model's config from them, changing only what training
  changed (megamoe.interop.hf_config).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megamoe.bounded import read_bytes_bounded
from megamoe.checkpointing.hf_moe_arch import MIN_CORPUS_VOCAB
from megamoe.checkpointing.layout import RELEASE
from megamoe.errors import CheckpointError
from megamoe.paths import inside
from megamoe.train.checkpoint_schema import TOKENIZER_KEY
from megamoe.train.checkpoint_tokenizer import (CHECKPOINT_TOKENIZER_DIR, HF_SOURCE_DIR,
                                                tokenizer_record)
from megamoe.train.tokenizer import copy_tokenizer, load_tokenizer
from megamoe.train.tokenizer.hf import CONFIG_FILES, SENTENCEPIECE_MODEL, TOKENIZER_JSON
from megamoe.upcycle.train_recipe import ConvertedModel

SOURCE_FILES = ("config.json", "generation_config.json")
SOURCE_RECORD = "conversion.json"
MAX_SOURCE_BYTES = 1 << 20
"""A config.json / generation_config.json larger than this (1 MiB) is refused unread."""
TOKENIZER_MARKERS = (TOKENIZER_JSON, SENTENCEPIECE_MODEL)
"""A model folder holding one of these ships a tokenizer megamoe reads."""


@dataclass(frozen=True)
class HFOrigin:
    """A converter's Hugging Face source: what its output carries and its train config says."""

    directory: Path
    tokenizer: Any
    """The model's Tokenizer, or None when the folder ships none megamoe reads."""
    record: dict
    """What `SOURCE_RECORD` holds."""
    model: ConvertedModel


def hf_origin(hf_dir: Path, save: Path, tool: str, description: str, arch, record: dict,
              notes: Optional[dict] = None) -> HFOrigin:
    """The HFOrigin of the model folder `hf_dir` converted to `save` (its tokenizer loaded and
    checked now, before anything is written; `arch` its checked HFArch)."""
    tokenizer = source_tokenizer(hf_dir)
    output = Path(save).expanduser().resolve()
    model = ConvertedModel(
        tool=tool, description=description, output=output,
        context=arch.max_position_embeddings,
        vocab_size=arch.vocab_size if arch.vocab_size >= MIN_CORPUS_VOCAB else None,
        tokenizer=None if tokenizer is None else output / RELEASE / CHECKPOINT_TOKENIZER_DIR,
        notes=notes or {})
    return HFOrigin(hf_dir, tokenizer, record, model)


def source_tokenizer(hf_dir: Path):
    """The tokenizer of the Hugging Face model folder `hf_dir` (a Tokenizer), None when the
    folder ships none megamoe reads; a DataError when the files are not a tokenizer, a
    CheckpointError when one is a link leaving the folder (nothing outside it is read)."""
    for name in (*TOKENIZER_MARKERS, *CONFIG_FILES):
        if os.path.lexists(hf_dir / name):
            inside(hf_dir, name)
    if not any((hf_dir / name).is_file() for name in TOKENIZER_MARKERS):
        return None
    return load_tokenizer(hf_dir)


def carry_hf_files(origin: HFOrigin, checkpoint_dir: Path) -> dict:
    """Copy the tokenizer (when there is one) and the source's config files of `origin` into
    `checkpoint_dir` (see the module docstring); returns the common-state entries to add."""
    common = {}
    kept = checkpoint_dir / HF_SOURCE_DIR
    kept.mkdir()
    for name in SOURCE_FILES:
        if (origin.directory / name).is_file():
            path = inside(origin.directory, name)
            raw = read_bytes_bounded(path, MAX_SOURCE_BYTES, CheckpointError, str(path))
            (kept / name).write_bytes(raw)
    if origin.tokenizer is not None:
        copied = copy_tokenizer(origin.tokenizer, checkpoint_dir / CHECKPOINT_TOKENIZER_DIR)
        # transformers picks the tokenizer class from config.json's model_type (Mixtral's is
        # not Llama's): with it the copy tokenizes as the model folder does.
        if (kept / SOURCE_FILES[0]).is_file():
            (copied / SOURCE_FILES[0]).write_bytes((kept / SOURCE_FILES[0]).read_bytes())
        common[TOKENIZER_KEY] = tokenizer_record(origin.tokenizer)
    (kept / SOURCE_RECORD).write_text(json.dumps(origin.record, indent=2) + "\n")
    return common


def kept_source(checkpoint_dir: Path) -> Optional[Path]:
    """The `hf_source/` of a checkpoint folder, None when it has none."""
    kept = checkpoint_dir / HF_SOURCE_DIR
    return kept if (kept / SOURCE_FILES[0]).is_file() else None


def tokenizer_line(origin: HFOrigin, use: str = "train_config.yaml trains on it "
                                                 "(data.tokenizer)") -> str:
    """The converter's line saying where the model's tokenizer went and how it is `use`d."""
    if origin.tokenizer is None:
        return (f"no tokenizer: {origin.directory} ships neither {' nor '.join(TOKENIZER_MARKERS)};"
                " name the model's tokenizer when training (data.tokenizer)")
    return (f"tokenizer {origin.tokenizer.describe()} copied to {origin.model.tokenizer}; {use}")
