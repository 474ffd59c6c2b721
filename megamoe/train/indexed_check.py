"""Check a Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`) before Megatron reads it.

The `.idx` layout is Megatron-Core's (`megatron/core/datasets/indexed_dataset.py`,
`_IndexWriter` / `_IndexReader`): the 9-byte magic `MMIDIDX\\0\\0`, version 1 (<Q), the token
dtype code (<B), the sequence and document counts (<Q each), then int32 sequence lengths, int64
byte pointers into `.bin` and int64 document boundaries. Megatron asserts on a bad header and
reads past the end of a short or mismatched file; here each inconsistency is one DataError
naming the file: a truncated index, pointers that do not follow the lengths, a `.bin` whose size
is not what the index describes (a `.bin`/`.idx` pair from different runs), and token ids
outside the tokenizer's vocabulary (a damaged `.bin`; all tokens up to SCAN_BYTES, beyond that
SAMPLE_WINDOWS evenly spaced windows, so a large corpus costs seconds, not minutes).
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Optional

import numpy as np

from megamoe.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
SCAN_BYTES = 2 << 30
SAMPLE_WINDOWS, WINDOW_BYTES = 512, 1 << 20
_FIX = "rebuild it with tools/preprocess_data.py"


def check_indexed_dataset(prefix: str, vocab_size: Optional[int] = None) -> None:
    """Raise a one-line DataError unless PREFIX.idx and PREFIX.bin are a consistent pair."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    if not idx.is_file() or not bin_.is_file():
        raise DataError(f"no indexed dataset at {prefix} ({prefix}.bin/.idx); build it with "
                        "tools/preprocess_data.py")
    raw = idx.read_bytes()
    if len(raw) < HEADER_BYTES or raw[:9] != MAGIC:
        raise DataError(f"{idx} is not a Megatron index file (bad header); {_FIX}")
    version, code, sequences, documents = struct.unpack("<QBQQ", raw[9:HEADER_BYTES])
    if version != 1 or code not in DTYPES:
        raise DataError(f"{idx} has version {version} / dtype code {code}, not a Megatron "
                        f"indexed dataset this reads; {_FIX}")
    need = HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if len(raw) < need:
        raise DataError(f"{idx} has {len(raw)} bytes but its header describes {need} "
                        f"(truncated or corrupt); {_FIX}")
    lengths = np.frombuffer(raw, np.int32, sequences, HEADER_BYTES).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, sequences, HEADER_BYTES + 4 * sequences)
    docs = np.frombuffer(raw, np.int64, documents, HEADER_BYTES + 12 * sequences)
    itemsize = np.dtype(DTYPES[code]).itemsize
    expected_pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * itemsize])
    if (lengths < 0).any() or not np.array_equal(pointers, expected_pointers[:sequences]):
        raise DataError(f"{idx}: sequence lengths and pointers disagree (corrupt index); {_FIX}")
    if documents and (docs[0] != 0 or docs[-1] != sequences or (np.diff(docs) < 0).any()):
        raise DataError(f"{idx}: document boundaries are not 0..{sequences} in order (corrupt "
                        f"index); {_FIX}")
    size = int(lengths.sum()) * itemsize
    if bin_.stat().st_size != size:
        raise DataError(f"{bin_} has {bin_.stat().st_size} bytes but {idx} describes {size}: the .bin and "
                        f".idx do not belong together; {_FIX}")
    if vocab_size is not None and size:
        tokens = np.memmap(bin_, dtype=DTYPES[code], mode="r")
        top, bottom = _extremes(tokens, itemsize)
        if top >= vocab_size or bottom < 0:
            raise DataError(f"{bin_} holds token id {int(top)} (or a negative one) outside the "
                            f"tokenizer's {vocab_size} ids (corrupt data or another tokenizer); "
                            f"{_FIX}")


def _extremes(tokens: np.ndarray, itemsize: int) -> tuple[int, int]:
    """(max, min) token id of all tokens, or of evenly spaced windows of a large file."""
    if tokens.nbytes <= SCAN_BYTES:
        return int(tokens.max()), int(tokens.min())
    window = WINDOW_BYTES // itemsize
    starts = np.linspace(0, len(tokens) - window, SAMPLE_WINDOWS).astype(np.int64)
    parts = [tokens[s:s + window] for s in starts]
    return max(int(p.max()) for p in parts), min(int(p.min()) for p in parts)
