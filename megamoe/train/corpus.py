"""The default training corpus: English prose that ships with Python, gathered offline.

Sources, all from the standard library of the running interpreter (so every machine with the same
Python build gathers the same bytes, in the same order):
- per module, in source order: its docstrings (module, class, function) and its comment blocks
  that read as prose; one document per module, modules in sorted path order, test suites and
  site-packages excluded;
- the language reference topics that `pydoc` serves (`pydoc_data/topics.py`), one document each.

`ensure_default_dataset` turns this into a Megatron indexed dataset, once per cache directory,
through the same code as tools/preprocess_data.py: tokenized with a given tokenizer (a model's
own, e.g. an imported model's: one dataset per tokenizer fingerprint), else with a SentencePiece
tokenizer trained on it (one per vocabulary size).
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

from tqdm import tqdm

from megamoe.atomic import atomic_directory
from megamoe.bounded import read_bytes_bounded
from megamoe.errors import DataError
from megamoe.train.data_prep import preprocess
from megamoe.train.tokenizer import Tokenizer

CORPUS_VERSION = 1  # bump when the gathering rules change: it names the cache entry
DEFAULT_VOCAB_SIZE = 4096
MIN_DOCSTRING_CHARS = 40
MIN_COMMENT_CHARS = 80
MIN_PROSE_FRACTION = 0.85  # letters and spaces over all characters of a comment block
MAX_SOURCE_BYTES = 16 << 20  # the largest stdlib module (pydoc_data/topics.py) is < 1 MiB
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _is_prose(text: str) -> bool:
    letters = sum(c.isalpha() or c == " " for c in text)
    return len(text) >= MIN_COMMENT_CHARS and letters >= MIN_PROSE_FRACTION * len(text)


def _comment_blocks(lines: list[str], string_lines: set[int]) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each run of whole-line comments outside string literals."""
    block: list[str] = []
    first = 0
    for lineno, line in enumerate(lines + [""], start=1):
        stripped = line.strip()
        if stripped.startswith("#") and lineno not in string_lines:
            text = stripped.lstrip("#").strip()
            if text:
                first = first or lineno
                block.append(text)
                continue
        if block:
            yield first, " ".join(block)
        block, first = [], 0


def module_text(source: bytes, seen: set[str]) -> str:
    """The prose of one module: docstrings and prose comment blocks in source order.

    Texts already in `seen` are skipped (and new ones added), so repeated boilerplate appears
    once per corpus. Returns "" for a module without prose or that does not parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    items: list[tuple[int, str]] = []
    string_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            string_lines.update(range(node.lineno + 1, node.end_lineno + 1))
        elif isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                items.append((node.body[0].lineno, doc))
    lines = source.decode("utf-8", errors="replace").splitlines()
    items += [item for item in _comment_blocks(lines, string_lines) if _is_prose(item[1])]
    kept = []
    for _, text in sorted(items):
        if text not in seen:
            seen.add(text)
            kept.append(text)
    return "\n\n".join(kept)


def stdlib_documents(stdlib_dir: str | os.PathLike | None = None) -> Iterator[tuple[str, str]]:
    """Yield (source, text) documents of the standard library at `stdlib_dir` (default: ours).

    Order and content depend only on the files, so they are reproducible across machines that
    have the same Python build.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    modules = sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if not _EXCLUDED_DIRS & set(path.relative_to(root).parts)
    )
    seen: set[str] = set()
    for rel in modules:
        text = module_text(_source(root / rel), seen)
        if text:
            yield f"stdlib/{rel}", text
    topics_file = root / "pydoc_data" / "topics.py"
    if topics_file.is_file():
        topics = _topics(_source(topics_file))
        for key in sorted(topics):
            yield f"pydoc_data/{key}", topics[key]


def _source(path: Path) -> bytes:
    """The bytes of one source file of the standard library (at most MAX_SOURCE_BYTES)."""
    return read_bytes_bounded(path, MAX_SOURCE_BYTES, DataError, f"source file {path}")


def _topics(source: bytes) -> dict[str, str]:
    """The `topics` dict literal of pydoc_data/topics.py, read without importing it."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return {}


def default_dataset_dir(cache_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE,
                        tokenizer: Optional[Tokenizer] = None) -> Path:
    """Where `ensure_default_dataset` keeps the dataset of this Python, corpus version, and
    tokenizer: `tokenizer`'s fingerprint, else the size of the tokenizer trained for it."""
    version = ".".join(map(str, sys.version_info[:3]))
    which = f"vocab{vocab_size}" if tokenizer is None else f"tokenizer-{tokenizer.fingerprint[:16]}"
    return Path(cache_dir) / f"stdlib-corpus-py{version}-v{CORPUS_VERSION}-{which}"


def ensure_default_dataset(
    cache_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE, progress: bool = True,
    tokenizer: Optional[Tokenizer] = None,
) -> tuple[str, str]:
    """Build (once) the default dataset under `cache_dir`; return (data_prefix, tokenizer path).

    The directory holds `corpus.jsonl` (the gathered documents, fields `text` and `source`),
    `text_document.bin/.idx` with their tokenizer identity (`text_document.tokenizer-identity.
    json`), tokenized with `tokenizer`, or (None) with the tokenizer `text_document.model` of
    `vocab_size` pieces trained on it. It appears atomically and concurrent callers (several
    ranks on one machine) wait for the one that builds it.
    """
    target = default_dataset_dir(cache_dir, vocab_size, tokenizer)
    prefix = target / "text_document"
    model = target / "text_document.model" if tokenizer is None else Path(tokenizer.path)
    # not the identity file: a cache from before identities has none, and the trainer then
    # checks the data's ids and document ends instead
    outputs = (
        target / "text_document.bin",
        target / "text_document.idx",
        *([model] if tokenizer is None else []),
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(p.is_file() for p in outputs):
            with atomic_directory(target, overwrite=True, owner="default_corpus") as tmp:
                corpus = tmp / "corpus.jsonl"
                with open(corpus, "w", encoding="utf-8") as f:
                    gathered = stdlib_documents()
                    for source, text in tqdm(
                        gathered, desc="gathering text", unit="doc", disable=not progress
                    ):
                        f.write(json.dumps({"text": text, "source": source}) + "\n")
                how = (dict(vocab_size=vocab_size) if tokenizer is None else
                       dict(tokenizer_model=tokenizer.path))
                preprocess([corpus], tmp / "text_document", progress=progress, **how)
    return str(prefix), str(model)
