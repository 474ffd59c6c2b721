"""Which tokenizer a dataset, a checkpoint or an import was made with: `identity(tokenizer)`, the
record written beside every dataset megamoe makes (`PREFIX.tokenizer-identity.json`) and into
checkpoints and import outputs, and the loader that names a tokenizer by its path."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megamoe.atomic import atomic_directory, atomic_write_text
from megamoe.bounded import read_json, regular_file_size
from megamoe.errors import DataError
from megamoe.train.tokenizer.base import Tokenizer
from megamoe.train.tokenizer.hf import (MODEL_CONFIG, TOKENIZER_JSON, HuggingFaceTokenizer,
                                        has_hf_files)
from megamoe.train.tokenizer.spm import MAX_MODEL_BYTES, SentencePieceTokenizer

IDENTITY_SUFFIX = ".tokenizer-identity.json"
_IDENTITY_KEYS = {"fingerprint": str, "kind": str, "vocab_size": int, "eod": int, "bos": int,
                  "add_bos": bool}
_MAX_IDENTITY_BYTES = 1 << 20
_HASH_CHUNK = 1 << 20
_MAX_INDEX_BYTES = 1 << 40  # a .idx holds ~10 bytes per document
_SNIFF_BYTES = 64


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at `path`: a SentencePiece `.model` file, a Hugging Face `tokenizer.json`
    file, or a folder holding `tokenizer.json` and/or `tokenizer.model` with their configs (see
    `hf`). Files are read within size limits and no code from them runs; anything else is a
    one-line DataError naming the path and the fix."""
    source = Path(path).expanduser()
    if source.is_dir():
        if has_hf_files(source):
            return HuggingFaceTokenizer(source)
        if os.path.lexists(source / "tokenizer.model"):
            return SentencePieceTokenizer(source / "tokenizer.model")
        raise DataError(f"tokenizer folder {source} holds no {TOKENIZER_JSON}, "
                        "tokenizer_config.json or tokenizer.model; pass the model folder with "
                        "its tokenizer files, a tokenizer.json or a SentencePiece .model file")
    regular_file_size(source, MAX_MODEL_BYTES, DataError, f"tokenizer {source}")
    with open(source, "rb") as f:
        head = f.read(_SNIFF_BYTES).lstrip()
    if head.startswith(b"{"):
        return HuggingFaceTokenizer(source)
    return SentencePieceTokenizer(source)


def identity(tokenizer: Tokenizer) -> dict:
    """What names a tokenizer wherever its ids are stored: {fingerprint, kind, vocab_size, eod,
    bos, add_bos}."""
    return {"fingerprint": tokenizer.fingerprint, "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "bos": tokenizer.bos,
            "add_bos": tokenizer.add_bos}


def copy_tokenizer(tokenizer: Tokenizer, folder: str | os.PathLike,
                   overwrite: bool = False) -> Path:
    """Copy the files of `tokenizer` into `folder` (a temporary folder renamed into place, so it
    is whole or absent; `overwrite` replaces a folder this function wrote before). Loading
    `folder` gives the same fingerprint. Returns `folder`."""
    folder = Path(folder)
    with atomic_directory(folder, owner="copy_tokenizer", overwrite=overwrite) as tmp:
        write_tokenizer_files(tokenizer, tmp)
        if tokenizer.model_type is not None:
            (tmp / MODEL_CONFIG).write_text(json.dumps({"model_type": tokenizer.model_type}))
    return folder


def write_tokenizer_files(tokenizer: Tokenizer, folder: Path) -> list[str]:
    """Write the files of `tokenizer` into the existing `folder`, the bytes it was loaded (and
    fingerprinted) from, not what its source paths hold now, a lone file under the name a model
    folder gives it (so the folder loads as the file did); returns their names."""
    single = {"sentencepiece": "tokenizer.model", "huggingface": TOKENIZER_JSON}[tokenizer.kind]
    names = []
    for source, data in tokenizer.files.items():
        name = single if len(tokenizer.files) == 1 else source.name
        (folder / name).write_bytes(data)
        names.append(name)
    return names


def describe_identity(record: dict) -> str:
    """A recorded tokenizer, as `Tokenizer.describe()` shows a loaded one: its source (or kind),
    vocabulary size, end-of-document id and the first 12 hex digits of its fingerprint."""
    source = record.get("source") or f"a {record.get('kind', 'unnamed')} tokenizer"
    return (f"{source} ({record['vocab_size']} ids, eod {record['eod']}, fingerprint "
            f"{record['fingerprint'][:12]})")


def identity_path(prefix: str | os.PathLike) -> Path:
    """The identity sidecar of the dataset `prefix` (PREFIX.bin/.idx)."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + IDENTITY_SUFFIX)


def index_checksum(idx: str | os.PathLike) -> str:
    """Hex sha256 of a dataset's index file, `PREFIX.idx` (a few bytes per document)."""
    digest = hashlib.sha256()
    with open(idx, "rb") as index:
        while chunk := index.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def dataset_identity(tokenizer: Tokenizer, idx_sha256: str) -> str:
    """The text of a dataset's sidecar: `identity(tokenizer)`, the tokenizer's path, the parts
    that decide its ids (`components`) and the checksum of the dataset's `.idx` it describes
    (a record copied beside other data is caught)."""
    record = {**identity(tokenizer), "source": tokenizer.path,
              "components": tokenizer.components, "idx_sha256": idx_sha256}
    return json.dumps(record, indent=1) + "\n"


def write_dataset_identity(prefix: str | os.PathLike, tokenizer: Tokenizer) -> Path:
    """Write `PREFIX.tokenizer-identity.json` for the dataset `prefix` (its .idx written)
    tokenized by `tokenizer` (atomic)."""
    path = identity_path(prefix)
    atomic_write_text(path, dataset_identity(tokenizer, index_checksum(f"{prefix}.idx")))
    return path


def read_dataset_identity(prefix: str | os.PathLike) -> dict | None:
    """The identity recorded beside the dataset `prefix`, or None when there is none (data
    made elsewhere, e.g. by Megatron-LM's preprocess_data.py). A malformed record, or one whose
    `.idx` checksum is not the dataset's, is a one-line DataError. Records older than the
    components and the checksum have neither."""
    path = identity_path(prefix)
    if not os.path.lexists(path):
        return None
    record = read_json(path, _MAX_IDENTITY_BYTES, DataError)
    fix = "remove it and rerun tools/preprocess_data.py for this dataset"
    if not isinstance(record, dict):
        raise DataError(f"{path} is not a tokenizer identity (a JSON object); {fix}")
    for key, kind in _IDENTITY_KEYS.items():
        value = record.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise DataError(f"{path}: {key!r} is missing or not a {kind.__name__}; {fix}")
    components = record.get("components", {})
    if not (isinstance(components, dict) and
            all(isinstance(value, str) for value in components.values())):
        raise DataError(f"{path}: 'components' is not a mapping of names to digests; {fix}")
    checksum = record.get("idx_sha256")
    idx = f"{prefix}.idx"
    if checksum is not None:
        regular_file_size(idx, _MAX_INDEX_BYTES, DataError, f"the index {idx} of the dataset "
                          f"{path} describes")
    if checksum is not None and checksum != index_checksum(idx):
        raise DataError(f"{path} describes other data: its .idx checksum is not that of "
                        f"{idx} (a record copied from another dataset?); {fix}")
    return record
