"""Check a Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`) before Megatron reads it.

The `.idx` layout is Megatron-Core's (`megatron/core/datasets/indexed_dataset.py`,
`_IndexWriter` / `_IndexReader`): the 9-byte magic `MMIDIDX\\0\\0`, version 1 (<Q), the token
dtype code (<B), the sequence and document counts (<Q each), then int32 sequence lengths, int64
byte pointers into `.bin` and int64 document boundaries. Megatron asserts on a bad header and
reads past the end of a short or mismatched file; here each inconsistency is one DataError
naming the file: a truncated index, pointers that do not follow the lengths, a `.bin` whose size
is not what the index describes (a `.bin`/`.idx` pair from different runs), and token ids
outside the tokenizer's vocabulary (a damaged `.bin`, or data of another tokenizer; all tokens up
to SCAN_BYTES, beyond that SAMPLE_WINDOWS evenly spaced windows, so a large corpus costs seconds,
not minutes). Given the tokenizer's end-of-document id, it also checks that documents end with
it, as Megatron-LM's `preprocess_data.py --append-eod` and tools/preprocess_data.py write them
(every document up to MAX_DOCUMENT_ENDS, beyond that as many evenly spaced ones): data made
without it would train on documents run together. Both files are read a bounded chunk at a
time, never whole, after their sizes are checked against what the header claims.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Optional

import numpy as np

from megamoe.bounded import regular_file_size
from megamoe.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
SCAN_BYTES = 2 << 30
SAMPLE_WINDOWS, WINDOW_BYTES = 512, 1 << 20
CHUNK_ITEMS = 1 << 17  # index entries read at a time: ~4 MiB of arrays at most
MAX_FILE_BYTES = 1 << 46  # 64 TiB: beyond any corpus; sizes past it are damage
INT64_MAX = int(np.iinfo(np.int64).max)
MAX_DOCUMENT_ENDS = 1 << 16
_FIX = "rebuild it with tools/preprocess_data.py"
_TOKENIZER_FIX = ("set data.tokenizer to the tokenizer the data was made with, or rebuild the data "
                  "with tools/preprocess_data.py --tokenizer")


def check_indexed_dataset(prefix: str, vocab_size: Optional[int] = None,
                          eod: Optional[int] = None, tokenizer: str = "") -> None:
    """Raise a one-line DataError unless PREFIX.idx and PREFIX.bin are a consistent pair, whose
    token ids are below `vocab_size` and whose documents end in `eod` (when given; `tokenizer`,
    e.g. `Tokenizer.describe()`, names the tokenizer in messages).

    Memory stays a few MiB whatever the files' sizes: the header's counts are checked against
    the index's real size before anything is allocated, and the arrays are read CHUNK_ITEMS
    entries at a time."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    named = f"of {tokenizer} " if tokenizer else ""  # for the messages
    if not idx.exists() or not bin_.exists():
        raise DataError(f"no indexed dataset at {prefix} ({prefix}.bin/.idx); build it with "
                        "tools/preprocess_data.py")
    idx_size = regular_file_size(idx, MAX_FILE_BYTES, DataError, f"index {idx}")
    bin_size = regular_file_size(bin_, MAX_FILE_BYTES, DataError, f"token file {bin_}")
    with open(idx, "rb", buffering=0) as f:
        header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES or header[:9] != MAGIC:
            raise DataError(f"{idx} is not a Megatron index file (bad header); {_FIX}")
        version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
        if version != 1 or code not in DTYPES:
            raise DataError(f"{idx} has version {version} / dtype code {code}, not a Megatron "
                            f"indexed dataset this reads; {_FIX}")
        need = HEADER_BYTES + sequences * (4 + 8) + documents * 8
        if idx_size < need:
            raise DataError(f"{idx} has {idx_size} bytes but its header describes {need} "
                            f"(truncated or corrupt); {_FIX}")
        itemsize = np.dtype(DTYPES[code]).itemsize
        docs_at = HEADER_BYTES + 12 * sequences
        if documents and (_read(f, np.int64, docs_at, 1)[0] != 0 or
                          _read(f, np.int64, docs_at + 8 * (documents - 1), 1)[0] != sequences):
            raise DataError(f"{idx}: document boundaries are not 0..{sequences} (corrupt "
                            f"index); {_FIX}")
        size = _check_pointers(f, idx, sequences, itemsize)
        _check_documents(f, idx, docs_at, documents)
        ends = [] if eod is None or bin_size != size else \
            _document_ends(f, sequences, documents, itemsize)
    if bin_size != size:
        raise DataError(f"{bin_} has {bin_size} bytes but {idx} describes {size}: the .bin and "
                        f".idx do not belong together; {_FIX}")
    if vocab_size is not None and size:
        top, bottom = _extremes(bin_, DTYPES[code], size // itemsize)
        if top >= vocab_size or bottom < 0:
            raise DataError(f"{bin_} holds token id {int(top)} (or a negative one) outside the "
                            f"tokenizer's {vocab_size} ids {named}(corrupt data or another "
                            f"tokenizer); {_TOKENIZER_FIX}")
    if ends:
        _check_document_ends(bin_, DTYPES[code], ends, eod, named)


def _read(f: BinaryIO, dtype: type, offset: int, count: int,
          out: Optional[np.ndarray] = None) -> np.ndarray:
    """`count` values of `dtype` at byte `offset` of the open file `f` (whose size was checked
    to hold them), into the front of `out` when given (a buffer reused across chunks)."""
    values = np.empty(count, dtype) if out is None else out[:count]
    f.seek(offset)
    if f.readinto(values) != values.nbytes:
        raise DataError(f"{f.name} changed while it was read; check that nothing writes it")
    return values


def _check_pointers(f: BinaryIO, idx: Path, sequences: int, itemsize: int) -> int:
    """The token bytes the index describes, after checking that every pointer is where the
    lengths before it put it (Megatron's writer: pointer i = sum of lengths[:i] x itemsize)."""
    total = 0
    buffers = np.empty(CHUNK_ITEMS, np.int32), np.empty(CHUNK_ITEMS, np.int64)
    for first in range(0, sequences, CHUNK_ITEMS):
        count = min(CHUNK_ITEMS, sequences - first)
        lengths = _read(f, np.int32, HEADER_BYTES + 4 * first, count, buffers[0]).astype(np.int64)
        pointers = _read(f, np.int64, HEADER_BYTES + 4 * sequences + 8 * first, count, buffers[1])
        expected = total + (np.cumsum(lengths) - lengths) * itemsize
        if total > INT64_MAX or (lengths < 0).any() or not np.array_equal(pointers, expected):
            raise DataError(f"{idx}: sequence lengths and pointers disagree (corrupt index); "
                            f"{_FIX}")
        total += int(lengths.sum()) * itemsize
    return total


def _check_documents(f: BinaryIO, idx: Path, offset: int, documents: int) -> None:
    """Document boundaries never decrease (the first and last were checked already)."""
    previous, buffer = 0, np.empty(CHUNK_ITEMS, np.int64)
    for first in range(0, documents, CHUNK_ITEMS):
        docs = _read(f, np.int64, offset + 8 * first, min(CHUNK_ITEMS, documents - first), buffer)
        if docs[0] < previous or (np.diff(docs) < 0).any():
            raise DataError(f"{idx}: document boundaries are not in order (corrupt index); "
                            f"{_FIX}")
        previous = docs[-1]


def _document_ends(f: BinaryIO, sequences: int, documents: int,
                   itemsize: int) -> list[tuple[int, int]]:
    """(document number, byte offset in `.bin` of its last token) of every non-empty document,
    or of MAX_DOCUMENT_ENDS evenly spaced ones of a larger dataset."""
    count = documents - 1
    chosen = range(count) if count <= MAX_DOCUMENT_ENDS else \
        np.linspace(0, count - 1, MAX_DOCUMENT_ENDS).astype(np.int64)
    docs_at, ends = HEADER_BYTES + 12 * sequences, []
    for doc in map(int, chosen):
        start, stop = _read(f, np.int64, docs_at + 8 * doc, 2)
        last = int(stop) - 1  # the document's last sequence
        length = int(_read(f, np.int32, HEADER_BYTES + 4 * last, 1)[0]) if stop > start else 0
        if length:
            pointer = int(_read(f, np.int64, HEADER_BYTES + 4 * sequences + 8 * last, 1)[0])
            ends.append((doc, pointer + (length - 1) * itemsize))
    return ends


def _check_document_ends(bin_: Path, dtype: type, ends: list[tuple[int, int]], eod: int,
                         named: str) -> None:
    """Every listed document's last token is `eod` (`named`: "of <tokenizer> " or "")."""
    with open(bin_, "rb", buffering=0) as f:
        for doc, offset in ends:
            token = int(_read(f, dtype, offset, 1)[0])
            if token != eod:
                raise DataError(f"{bin_}: document {doc} ends with token {token}, not the "
                                f"end-of-document id {eod} {named}(data made without "
                                f"end-of-document tokens, or with another tokenizer); "
                                f"{_TOKENIZER_FIX}")


def _extremes(bin_: Path, dtype: type, count: int) -> tuple[int, int]:
    """(max, min) token id of all `count` tokens of `bin_`, or of evenly spaced windows of a
    large file, read one window at a time."""
    itemsize = np.dtype(dtype).itemsize
    window = WINDOW_BYTES // itemsize
    if count * itemsize <= SCAN_BYTES:
        starts = range(0, count, window)
    else:
        starts = np.linspace(0, count - window, SAMPLE_WINDOWS).astype(np.int64)
    top, bottom = None, None
    with open(bin_, "rb", buffering=0) as f:
        for start in starts:
            part = _read(f, dtype, int(start) * itemsize, min(window, count - int(start)))
            top = int(part.max()) if top is None else max(top, int(part.max()))
            bottom = int(part.min()) if bottom is None else min(bottom, int(part.min()))
    return top, bottom
