"""Tokenize text corpora into Megatron indexed datasets (PREFIX.bin / PREFIX.idx).

Input formats, chosen by file name:
- `*.jsonl` / `*.json`: one JSON object a line; the document is the string under `json_key`
  (blank lines are skipped);
- any other file: plain UTF-8 text; every blank-line-separated paragraph is one document.
Each document is written as the ids its tokenizer gives it (`Tokenizer.document_encoder`: for a
Hugging Face tokenizer `AutoTokenizer(text)["input_ids"]`, BOS included when the model adds
one) followed by the end-of-document id: the stream Megatron-LM's `tools/preprocess_data.py
--append-eod` writes (like it, a document without any token is left out).

The tokenizer is any `load_tokenizer` reads (a model folder, a tokenizer.json, a SentencePiece
model) or a SentencePiece model trained here on the same corpus and saved as PREFIX.model.
Beside the dataset goes its tokenizer's identity, PREFIX.tokenizer-identity.json.

Speed and memory: the input is cut into blocks of about BLOCK_BYTES at line ends and `workers`
processes tokenize blocks (parse the JSON, encode the batch with the tokenizers library or
sentencepiece) while this process writes finished blocks in input order. At most
MAX_IN_FLIGHT_BYTES of input (or one larger block) are handed out and not yet written, so
memory is bounded whatever the input size, and the window is wide enough that the other
workers keep busy while one encodes a document of megabytes (a window of a few blocks per
worker left them idle behind it). A worker's peak is set by the longest document it encodes:
the tokenizers library holds about 150-220 bytes per byte of a document while encoding it (1.2
GiB for 8 MiB of text with a 50,000-entry byte-level BPE), so a document longer than
`max_document_bytes` (`--max-document-mb`, default MAX_DOCUMENT_BYTES: 8 MiB) is refused in one
line naming its file and line (a jsonl line may hold at most MAX_RECORD_BYTES). All outputs are
written under temporary names and renamed into place only when everything succeeded, so a
failure leaves nothing behind.

Bounded time: a tokenizer's normalizer and pre-tokenizer run regular expressions, and a
super-linear one (`\\S*\\d` is quadratic in the length of a word without a digit: a 1 MB word
takes about an hour) would hold a worker for as long. So each block must be encoded within
`encode_deadline_s` of its size (30 s plus 1 s per 16 KiB, a hundred times what the slowest
tokenizer needs) once it is the oldest in flight, or the run stops with one line naming the
file, the bytes and the tokenizer's regular expressions. A pattern whose backtracking the regex
engine gives up on (an exponential one) is one line too, not the engine's panic.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from megamoe.bounded import decode_utf8, parse_json, regular_file_size
from megamoe.errors import DataError, one_line
from megamoe.paths import refuse_overlap
from megamoe.train.indexed_write import IndexedWriter, token_dtype
from megamoe.train.tokenizer import (SentencePieceTokenizer, Tokenizer, dataset_identity,
                                     identity_path, index_checksum, load_tokenizer,
                                     train_sentencepiece)

JSONL_SUFFIXES = (".jsonl", ".json")
BLOCK_BYTES = 1 << 20  # input bytes per task: large enough to amortise a task, small to stream
MAX_RECORD_BYTES = 256 << 20  # one jsonl line
MAX_DOCUMENT_BYTES = 8 << 20  # one document's text, UTF-8 (`--max-document-mb`)
MAX_INPUT_BYTES = 1 << 50
MAX_IN_FLIGHT_BYTES = 64 << 20  # input handed to workers and not yet written
ENCODE_BASE_S = 30.0
ENCODE_MIN_BYTES_PER_S = 16 << 10


@dataclass(frozen=True)
class PrepSummary:
    """What one preprocessing run wrote."""

    output_prefix: str
    tokenizer_model: str
    documents: int
    tokens: int  # including one EOD per document
    seconds: float
    input_bytes: int = 0

    def line(self) -> str:
        """One human-readable summary line."""
        rate = self.tokens / max(self.seconds, 1e-9)
        return (
            f"wrote {self.output_prefix}.bin/.idx: {self.documents} documents, "
            f"{self.tokens} tokens in {self.seconds:.1f} s ({rate:,.0f} tokens/s; tokenizer "
            f"{self.tokenizer_model})"
        )


@dataclass(frozen=True)
class Block:
    """A task: whole jsonl lines (`raw`, starting at line `first_line` of `path`) or, for text
    files, the documents themselves."""

    path: str
    first_line: int
    size: int  # input bytes
    raw: bytes = b""
    documents: tuple[str, ...] = ()
    json_key: str = "text"
    max_document_bytes: int = MAX_DOCUMENT_BYTES


def _document_too_long(where: str, limit: int) -> DataError:
    return DataError(f"{where}: a document longer than {limit:,} bytes, the limit of "
                     f"--max-document-mb {limit / (1 << 20):g} (tokenizing one document takes "
                     "memory in proportion to its size); split the document, or raise "
                     "--max-document-mb")


def check_document_size(text: str, limit: int, where: str) -> None:
    """A document longer than `limit` UTF-8 bytes is refused (one line naming `where`): its
    encoding's memory grows with it (see the module docstring)."""
    if len(text) > limit // 4 and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise _document_too_long(where, limit)


def _jsonl_documents(block: Block) -> list[str]:
    texts = []
    for number, raw in enumerate(block.raw.split(b"\n"), start=block.first_line):
        if not raw.strip():
            continue
        where = f"{block.path}:{number}"
        record = parse_json(decode_utf8(raw, DataError, where), DataError, where)
        text = record.get(block.json_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{where}: no string field {block.json_key!r}; pass --json-key with "
                            "the name of the field that holds the text")
        check_document_size(text, block.max_document_bytes, where)
        texts.append(text)
    return texts


_ENCODER: Callable[[Sequence[str]], list[list[int]]] | None = None
_DTYPE: np.dtype | None = None


def _start_worker(encoder: Callable, dtype: np.dtype) -> None:
    """Worker initializer: one tokenizer per process, single-threaded (the processes are the
    parallelism). The signals a forked worker inherits from a trainer (which only records a
    stop) go back to what a worker needs: SIGTERM ends it (the pool ends its workers so), and
    SIGINT and SIGUSR1, which reach every process of a terminal or a Slurm step, are left to
    the process that owns the pool. Its stderr is silenced, as a regex engine's panic prints its
    backtrace there (the failure itself comes back as `BackendGaveUp`)."""
    global _ENCODER, _DTYPE
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    _ENCODER, _DTYPE = encoder, dtype


class BackendGaveUp(Exception):
    """The tokenizer's native backend stopped on a block (the `tokenizers` regex engine's
    backtracking limit raises a Rust panic, which is not an Exception)."""


def encode_block(block: Block) -> tuple[np.ndarray, np.ndarray, int]:
    """In a worker: (token ids end to end, each document's length, input bytes) of a block;
    documents without any token besides EOD are left out, as Megatron-LM leaves them out."""
    texts = _jsonl_documents(block) if block.raw else list(block.documents)
    try:
        encoded = _ENCODER(texts) if texts else []
    except BaseException as err:  # noqa: BLE001 - pyo3's PanicException derives from it
        if type(err).__name__ != "PanicException":
            raise
        raise BackendGaveUp(one_line(str(err))) from None
    docs = [ids for ids in encoded if len(ids) > 1]
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int32, count=len(docs))
    tokens = np.fromiter((t for d in docs for t in d), dtype=_DTYPE, count=int(lengths.sum()))
    return tokens, lengths, block.size


def _line_blocks(f: BinaryIO, path: Path, json_key: str, max_document_bytes: int
                 ) -> Iterator[Block]:
    """Blocks of whole lines of about BLOCK_BYTES; a line longer than MAX_RECORD_BYTES is
    refused when that many bytes have been read without a line end."""
    pieces: list[bytes] = []  # the line being read, which has no line end yet
    pending, line = 0, 1
    while chunk := f.read(BLOCK_BYTES):
        end = chunk.rfind(b"\n")
        if end < 0:
            pieces.append(chunk)
            pending += len(chunk)
            if pending > MAX_RECORD_BYTES:
                raise DataError(f"{path}:{line}: a line longer than {MAX_RECORD_BYTES:,} bytes, "
                                "the limit for one record; split the document")
            continue
        whole = b"".join([*pieces, chunk[:end]])
        yield Block(str(path), line, len(whole) + 1, raw=whole, json_key=json_key,
                    max_document_bytes=max_document_bytes)
        line += whole.count(b"\n") + 1
        pieces, pending = [chunk[end + 1:]], len(chunk) - end - 1
    if pending:
        yield Block(str(path), line, pending, raw=b"".join(pieces), json_key=json_key,
                    max_document_bytes=max_document_bytes)


def _paragraphs(f: BinaryIO, path: Path, max_document_bytes: int
                ) -> Iterator[tuple[str, int]]:
    """(paragraph, input bytes up to its end) of a text file; a paragraph is one document."""
    paragraph: list[str] = []
    size = length = 0
    for lineno, raw in enumerate(iter(lambda: f.readline(max_document_bytes + 1), b""),
                                 start=1):
        size += len(raw)
        length = length + len(raw) if paragraph else len(raw)
        if length > max_document_bytes:  # its bytes, line ends included
            raise _document_too_long(f"{path}:{lineno}", max_document_bytes)
        line = decode_utf8(raw, DataError, f"{path}:{lineno}").rstrip("\r\n")
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "\n".join(paragraph), size
            paragraph, size = [], 0
    if paragraph or size:
        yield "\n".join(paragraph), size


def _paragraph_blocks(f: BinaryIO, path: Path, max_document_bytes: int) -> Iterator[Block]:
    batch: list[str] = []
    size = 0
    for doc, consumed in _paragraphs(f, path, max_document_bytes):
        if doc:
            batch.append(doc)
        size += consumed
        if size >= BLOCK_BYTES:
            yield Block(str(path), 0, size, documents=tuple(batch))
            batch, size = [], 0
    if size:
        yield Block(str(path), 0, size, documents=tuple(batch))


def input_blocks(paths: Sequence[Path], json_key: str = "text",
                 max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[Block]:
    """The blocks of `paths` in order (formats: see the module docstring); a document over
    `max_document_bytes` is refused when it is read."""
    for path in paths:
        with open(path, "rb") as f:
            if path.suffix.lower() in JSONL_SUFFIXES:
                yield from _line_blocks(f, path, json_key, max_document_bytes)
            else:
                yield from _paragraph_blocks(f, path, max_document_bytes)


def read_documents(paths: Sequence[Path], json_key: str = "text", desc: str = "reading",
                   progress: bool = True, max_document_bytes: int = MAX_DOCUMENT_BYTES
                   ) -> Iterator[str]:
    """Yield the documents of `paths` in order (formats: see the module docstring), with a bar
    over input bytes; raises DataError naming file and line on malformed input."""
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True,
              disable=None if progress else True) as bar:
        for block in input_blocks(paths, json_key, max_document_bytes):
            yield from _jsonl_documents(block) if block.raw else block.documents
            bar.update(block.size)


def _training_lines(paths: Sequence[Path], json_key: str, progress: bool,
                    max_document_bytes: int) -> Iterator[str]:
    for doc in read_documents(paths, json_key, desc="training tokenizer", progress=progress,
                              max_document_bytes=max_document_bytes):
        yield from (line for line in doc.split("\n") if line.strip())


def _check_outputs(targets: Sequence[Path], overwrite: bool) -> None:
    for target in targets:
        if target.exists() and not overwrite:
            raise DataError(
                f"output {target} exists; choose another output prefix or pass --overwrite"
            )


@contextlib.contextmanager
def _staged_outputs(targets: Sequence[Path]) -> Iterator[list[Path]]:
    """Yield temporary paths, one per target, renamed onto the targets (in order) only on
    success."""
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
        if not os.path.lexists(path):
            raise DataError(f"input file {path} does not exist; check the path")
        regular_file_size(path, MAX_INPUT_BYTES, DataError, f"input file {path}")
    return paths


def encode_deadline_s(size: int) -> float:
    """Seconds a worker has to encode a block of `size` input bytes."""
    return ENCODE_BASE_S + size / ENCODE_MIN_BYTES_PER_S


def _regexes(tokenizer: Tokenizer) -> str:
    patterns = tokenizer.regexes()
    return f" ({', '.join(repr(p) for p in patterns)})" if patterns else ""


def _finished(result, block: Block, start: int,
              tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray, int]:
    """The encoded block, waited for (as the oldest in flight) at most `encode_deadline_s` of
    its size, or a one-line DataError when that passed or the backend gave up on it."""
    where = f"{block.path} (bytes {start:,} to {start + block.size:,})"
    try:
        return result.get(encode_deadline_s(block.size))
    except multiprocessing.TimeoutError:
        raise DataError(f"{where}: tokenizing {block.size:,} bytes took over "
                        f"{encode_deadline_s(block.size):.0f} s (the bound: {ENCODE_BASE_S:g} s "
                        f"plus 1 s per {ENCODE_MIN_BYTES_PER_S:,} bytes): a "
                        f"regular expression of the tokenizer{_regexes(tokenizer)} is "
                        "super-linear on this text (a very long word, say); split such "
                        "documents or use a tokenizer without that pattern") from None
    except BackendGaveUp as err:
        raise DataError(f"{where}: the tokenizer gave up on this text ({err}): a regular "
                        f"expression of its normalizer or pre-tokenizer{_regexes(tokenizer)} "
                        "backtracks without bound; fix the pattern or remove the "
                        "document") from None


def _encoded_blocks(blocks: Iterator[Block], tokenizer: Tokenizer, dtype: np.dtype,
                    workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """`encode_block` of each block, in order, in `workers` processes with at most
    MAX_IN_FLIGHT_BYTES of input in flight (and at least one block); the oldest block must be
    done within `encode_deadline_s` of its size once it is waited for (the workers are ended
    when it is late)."""
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    pending: collections.deque = collections.deque()
    offsets: dict[str, int] = {}
    in_flight = 0
    with context.Pool(workers, initializer=_start_worker,
                      initargs=(tokenizer.document_encoder(), dtype)) as pool:
        for block in blocks:
            while pending and in_flight + block.size > MAX_IN_FLIGHT_BYTES:
                in_flight -= pending[0][1].size
                yield _finished(*pending.popleft(), tokenizer)
            start = offsets.get(block.path, 0)
            offsets[block.path] = start + block.size
            pending.append((pool.apply_async(encode_block, (block,)), block, start))
            in_flight += block.size
        while pending:
            yield _finished(*pending.popleft(), tokenizer)
        pool.close()  # the workers end on the pool's sentinel; leaving `with` ends the rest
        pool.join()


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
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
) -> PrepSummary:
    """Tokenize `inputs` into the Megatron indexed dataset `output_prefix`.bin/.idx, with its
    tokenizer identity `output_prefix`.tokenizer-identity.json.

    Exactly one of `tokenizer_model` (any tokenizer `load_tokenizer` reads) and `vocab_size`
    (train a `model_type` SentencePiece model of that size on `inputs` and save it as
    `output_prefix`.model) is given. `num_threads` worker processes tokenize (default: the
    cores this process may use). A document longer than `max_document_bytes` is refused.
    Returns counts and wall time.
    """
    start = time.perf_counter()
    if (tokenizer_model is None) == (vocab_size is None):
        raise DataError("pass exactly one of --tokenizer and --train-tokenizer --vocab-size")
    if not 0 < max_document_bytes <= MAX_RECORD_BYTES:
        raise DataError(f"--max-document-mb {max_document_bytes / (1 << 20):g} must be above 0 "
                        f"and at most {MAX_RECORD_BYTES >> 20} (the limit of one record)")
    paths = _check_inputs(inputs)
    prefix = Path(output_prefix)
    bin_, idx = prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
    model = prefix.with_name(prefix.name + ".model")
    # Renamed in this order: the index, which readers look for, last.
    targets = [*([model] if vocab_size is not None else []), bin_, identity_path(prefix), idx]
    if prefix.is_dir():
        raise DataError(f"--output-prefix {prefix} is a folder; the outputs are files named "
                        f"after the prefix: pass one inside it, e.g. {prefix / 'corpus'}")
    for target in [prefix, *targets]:
        refuse_overlap(target, [*paths, *([tokenizer_model] if tokenizer_model else [])],
                       flag="--output-prefix")
    _check_outputs(targets, overwrite)
    workers = num_threads or len(os.sched_getaffinity(0))
    tokenizer = None if tokenizer_model is None else load_tokenizer(tokenizer_model)
    total = sum(p.stat().st_size for p in paths)

    with _staged_outputs(targets) as staged:
        staged_bin, staged_identity, staged_idx = staged[-3:]
        if tokenizer is None:
            lines = _training_lines(paths, json_key, progress, max_document_bytes)
            staged[0].write_bytes(train_sentencepiece(lines, vocab_size, model_type, workers))
            tokenizer = SentencePieceTokenizer(staged[0])
            tokenizer.path = tokenizer.model_path = str(model.resolve())
            tokenizer.files = {model.resolve(): staged[0].read_bytes()}
        dtype = token_dtype(tokenizer.vocab_size)
        writer = IndexedWriter(staged_bin, staged_bin.with_suffix(".lengths"), dtype)
        try:
            # The bar shows on a terminal only (tqdm's disable=None), not in a log or a pipe.
            with tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True,
                      disable=None if progress else True) as bar:
                blocks = input_blocks(paths, json_key, max_document_bytes)
                for tokens, lengths, size in _encoded_blocks(blocks, tokenizer, dtype, workers):
                    writer.add(tokens, lengths)
                    rate = writer.documents / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{rate:,.0f} docs/s", refresh=False)
                    bar.update(size)
        finally:
            writer.close()
        if writer.documents == 0:
            names = ", ".join(str(p) for p in paths)
            raise DataError(f"no documents found in {names}; the inputs are empty")
        writer.finish(staged_idx)
        staged_identity.write_text(dataset_identity(tokenizer, index_checksum(staged_idx)))
    return PrepSummary(
        output_prefix=str(prefix),
        tokenizer_model=tokenizer.describe(),
        documents=writer.documents,
        tokens=writer.tokens,
        seconds=time.perf_counter() - start,
        input_bytes=total,
    )
