"""Write a Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`) one document at a time, in
memory bounded whatever the corpus size.

The layout is Megatron-Core's (`megatron/core/datasets/indexed_dataset.py`, `_IndexWriter`,
read back by `IndexedDataset`; see `indexed_check` for the fields): one sequence per document,
so the document boundaries are 0, 1, ..., N. Megatron's `IndexedDatasetBuilder` keeps every
length in Python lists until `finalize`; here the lengths go to a scratch file as they come and
the index is streamed from it `CHUNK_ITEMS` entries at a time.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from megamoe.train.indexed_check import CHUNK_ITEMS, DTYPES, MAGIC

_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """The token type of a vocabulary, by Megatron-Core's `DType.optimal_dtype`: uint16 below
    65,500 ids, int32 otherwise."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


class IndexedWriter:
    """Append documents (token arrays) to `bin_path`; `finish(idx_path)` writes the index.

    `scratch` is a file path for the lengths (removed by `finish`)."""

    def __init__(self, bin_path: str | os.PathLike, scratch: str | os.PathLike,
                 dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.documents = 0
        self.tokens = 0
        self._scratch = Path(scratch)
        self._bin: BinaryIO = open(bin_path, "wb")
        self._lengths: BinaryIO = open(self._scratch, "wb")

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: `tokens` is their ids end to end, `lengths` each one's count."""
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.write(np.ascontiguousarray(lengths, dtype=np.int32).tobytes())
        self.documents += len(lengths)
        self.tokens += int(tokens.size)

    def finish(self, idx_path: str | os.PathLike) -> None:
        """Close the token file and write the index for the documents added."""
        self._bin.close()
        self._lengths.close()
        count = self.documents
        itemsize = self.dtype.itemsize
        with open(idx_path, "wb") as idx:
            idx.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _CODES[self.dtype]))
            idx.write(struct.pack("<Q", count) + struct.pack("<Q", count + 1))
            for chunk in self._length_chunks():
                idx.write(chunk.tobytes())
            offset = 0
            for chunk in self._length_chunks():
                ends = np.cumsum(chunk, dtype=np.int64) * itemsize + offset
                idx.write(np.concatenate(([offset], ends[:-1])).astype(np.int64).tobytes())
                offset = int(ends[-1])
            for start in range(0, count + 1, CHUNK_ITEMS):
                idx.write(np.arange(start, min(start + CHUNK_ITEMS, count + 1),
                                    dtype=np.int64).tobytes())
        self._scratch.unlink()

    def _length_chunks(self):
        with open(self._scratch, "rb") as f:
            while chunk := f.read(CHUNK_ITEMS * 4):
                yield np.frombuffer(chunk, dtype=np.int32)

    def close(self) -> None:
        """Close the files (after a failure: the caller removes them)."""
        self._bin.close()
        self._lengths.close()
