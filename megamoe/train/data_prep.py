"""Tokenize text corpora into Megatron indexed datasets (PREFIX.bin / PREFIX.idx).

Input formats, chosen by file name:
- `*.jsonl` / `*.json`: one JSON object a line; the document is the string under `json_key`.
- any other file: plain UTF-8 text; every blank-line-separated paragraph is one document.
Empty documents are skipped. Each document is written as one sequence of token ids followed by
the end-of-document (EOD) token, with megatron-core's own `IndexedDatasetBuilder`.

The tokenizer is either an existing SentencePiece model or one trained here on the same corpus
and saved as PREFIX.model. All outputs are written under temporary names and renamed into place
only when everything succeeded, so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from megamoe.bounded import decode_utf8, parse_json
from megamoe.errors import DataError
from megamoe.paths import refuse_overlap
from megamoe.train.tokenizer import SentencePieceTokenizer, train_sentencepiece

JSONL_SUFFIXES = (".jsonl", ".json")
_ENCODE_BATCH = 256  # documents per sentencepiece call


@dataclass(frozen=True)
class PrepSummary:
    """What one preprocessing run wrote."""

    output_prefix: str
    tokenizer_model: str
    documents: int
    tokens: int  # including one EOD per document
    seconds: float

    def line(self) -> str:
        """One human-readable summary line."""
        return (
            f"wrote {self.output_prefix}.bin/.idx: {self.documents} documents, "
            f"{self.tokens} tokens in {self.seconds:.1f} s (tokenizer {self.tokenizer_model})"
        )


def _read_jsonl(f: BinaryIO, path: Path, json_key: str, bar: tqdm) -> Iterator[str]:
    for lineno, raw in enumerate(f, start=1):
        bar.update(len(raw))
        if not raw.strip():
            continue
        record = parse_json(decode_utf8(raw, DataError, f"{path}:{lineno}"), DataError,
                            f"{path}:{lineno}")
        text = record.get(json_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(
                f"{path}:{lineno}: no string field {json_key!r}; pass --json-key with the name of "
                "the field that holds the text"
            )
        yield text


def _read_paragraphs(f: BinaryIO, path: Path, bar: tqdm) -> Iterator[str]:
    paragraph: list[str] = []
    for lineno, raw in enumerate(f, start=1):
        bar.update(len(raw))
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise DataError(f"{path}:{lineno}: not UTF-8 text; convert the file to UTF-8") from None
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "\n".join(paragraph)
            paragraph = []
    if paragraph:
        yield "\n".join(paragraph)


def read_documents(
    paths: Sequence[Path], json_key: str = "text", desc: str = "reading", progress: bool = True
) -> Iterator[str]:
    """Yield the non-empty documents of `paths` in order (formats: see the module docstring).

    Shows a tqdm bar over input bytes; raises DataError naming file and line on malformed input.
    """
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress) as bar:
        for path in paths:
            with open(path, "rb") as f:
                if path.suffix.lower() in JSONL_SUFFIXES:
                    docs = _read_jsonl(f, path, json_key, bar)
                else:
                    docs = _read_paragraphs(f, path, bar)
                yield from (doc for doc in docs if doc.strip())


def _training_lines(paths: Sequence[Path], json_key: str, progress: bool) -> Iterator[str]:
    for doc in read_documents(paths, json_key, desc="training tokenizer", progress=progress):
        yield from (line for line in doc.split("\n") if line.strip())


def _check_outputs(targets: Sequence[Path], overwrite: bool) -> None:
    for target in targets:
        if target.exists() and not overwrite:
            raise DataError(
                f"output {target} exists; choose another output prefix or pass --overwrite"
            )


@contextlib.contextmanager
def _staged_outputs(targets: Sequence[Path]) -> Iterator[list[Path]]:
    """Yield temporary paths, one per target, renamed onto the targets only on success."""
    parent = targets[0].parent
    parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{targets[0].stem}.tmp-", dir=parent))
    try:
        yield [stage / target.name for target in targets]
        for target in targets:
            os.replace(stage / target.name, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _check_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    if not inputs:
        raise DataError("no input files given; pass one or more .jsonl or text files")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise DataError(f"input file {path} does not exist; check the path")
    return paths


def preprocess(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    *,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    model_type: str = "bpe",
    json_key: str = "text",
    overwrite: bool = False,
    progress: bool = True,
    num_threads: int | None = None,
) -> PrepSummary:
    """Tokenize `inputs` into the Megatron indexed dataset `output_prefix`.bin/.idx.

    Exactly one of `tokenizer_model` (an existing SentencePiece model) and `vocab_size` (train a
    `model_type` model of that size on `inputs` and save it as `output_prefix`.model) is given.
    Every document is followed by the tokenizer's EOD id. Returns counts and wall time.
    """
    start = time.perf_counter()
    if (tokenizer_model is None) == (vocab_size is None):
        raise DataError("pass exactly one of --tokenizer-model and --train-tokenizer --vocab-size")
    paths = _check_inputs(inputs)
    prefix = Path(output_prefix)
    targets = [prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")]
    if vocab_size is not None:
        targets.append(prefix.with_name(prefix.name + ".model"))
    for target in targets:
        refuse_overlap(target, [*paths, tokenizer_model], flag="--output-prefix")
    _check_outputs(targets, overwrite)
    threads = num_threads or len(os.sched_getaffinity(0))

    # The builder imports megatron-core (seconds); bad arguments are reported before that. Its
    # import warns about missing GPU libraries, which says nothing about preprocessing.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    with _staged_outputs(targets) as staged:
        if vocab_size is not None:
            lines = _training_lines(paths, json_key, progress)
            staged[2].write_bytes(train_sentencepiece(lines, vocab_size, model_type, threads))
            tokenizer = SentencePieceTokenizer(staged[2])
            model_path = str(targets[2])
        else:
            tokenizer = SentencePieceTokenizer(tokenizer_model)
            model_path = str(tokenizer_model)
        dtype = DType.optimal_dtype(tokenizer.vocab_size)
        builder = IndexedDatasetBuilder(str(staged[0]), dtype=dtype)
        documents = tokens = 0
        batch: list[str] = []

        def flush() -> None:
            nonlocal documents, tokens
            for ids in tokenizer.tokenize_batch(batch, threads):
                doc = np.asarray(ids + [tokenizer.eod], dtype=dtype)
                builder.add_document(doc, [doc.size])
                documents += 1
                tokens += doc.size
            batch.clear()

        for doc in read_documents(paths, json_key, desc="tokenizing", progress=progress):
            batch.append(doc)
            if len(batch) == _ENCODE_BATCH:
                flush()
        flush()
        if documents == 0:
            names = ", ".join(str(p) for p in paths)
            raise DataError(f"no documents found in {names}; the inputs are empty")
        builder.finalize(str(staged[1]))
    return PrepSummary(
        output_prefix=str(prefix),
        tokenizer_model=model_path,
        documents=documents,
        tokens=tokens,
        seconds=time.perf_counter() - start,
    )
