"""A released model's tokenizer as Hugging Face ships it: a `tokenizer.json` (the `tokenizers`
library's serialization), or a model folder holding one or a SentencePiece `tokenizer.model`,
with `tokenizer_config.json` / `special_tokens_map.json` / `generation_config.json`.

Documents are written as `transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]`
followed by the end-of-document id, exactly the stream Megatron-LM's `tools/preprocess_data.py
--tokenizer-type HuggingFaceTokenizer --append-eod` writes: its `HuggingFaceTokenizer.eod` is
the tokenizer's `eos_token`. So transformers builds the tokenizer (its classes decide the
pre-tokenizer and whether BOS is added, e.g. `add_bos_token`), but only from the files read here
within their size limits and copied to a private folder, with `trust_remote_code=False` (no code
from the folder runs) and without the network; the ids then come from the `tokenizers` backend
transformers configured, which is what its `__call__` runs.

When the files name no EOS (a `tokenizer.json` alone), the end of document is
`generation_config.json`'s `eos_token_id` (the first, if a list), else the one special token of
the vocabulary spelled like an end of text (`END_OF_TEXT_TOKENS`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from tokenizers import Tokenizer as BackendTokenizer

from megamoe.bounded import decode_utf8, parse_json, read_bytes_bounded
from megamoe.errors import DataError, one_line
from megamoe.paths import inside
from megamoe.train.tokenizer.base import Tokenizer, fingerprint
from megamoe.train.tokenizer.spm import MAX_MODEL_BYTES, load_proto

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
# Files transformers reads besides the vocabulary; generation_config.json only by megamoe (EOD).
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "generation_config.json")
MODEL_CONFIG = "config.json"  # transformers picks the tokenizer class from its model_type
MAX_TOKENIZER_BYTES = MAX_MODEL_BYTES  # the largest released tokenizer.json files are ~35 MB
MAX_CONFIG_BYTES = 16 << 20
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>",
                      "<|end▁of▁sentence|>", "<eos>", "<|eos|>", "[EOS]")
# Spaces, newlines, tabs, special tokens and non-ASCII text: load-time check that the backend
# alone gives the ids transformers' __call__ gives.
# The sections of a backend's serialization that decide how text becomes ids (the fingerprint).
_RULES = ("normalizer", "pre_tokenizer", "model", "post_processor")
_PROBE = "  Hello\tworld,\n\n naïve café 東京 😀 </s><s> <|endoftext|>x 12345  "


def has_hf_files(folder: Path) -> bool:
    """Whether `folder` holds a tokenizer.json or a tokenizer_config.json."""
    return any(os.path.lexists(folder / name) for name in (TOKENIZER_JSON, CONFIG_FILES[0]))


def _read_folder(folder: Path) -> dict[str, tuple[Path, bytes]]:
    """name -> (path, bytes) of the tokenizer files present in `folder`, each read within its
    limit; a folder without tokenizer.json or tokenizer.model is refused."""
    found = {}
    for name in (TOKENIZER_JSON, SENTENCEPIECE_MODEL, *CONFIG_FILES, MODEL_CONFIG):
        path = folder / name
        if os.path.lexists(path):
            path = inside(folder, name)  # a link out of the folder is refused
            limit = MAX_TOKENIZER_BYTES if name in (TOKENIZER_JSON, SENTENCEPIECE_MODEL) \
                else MAX_CONFIG_BYTES
            found[name] = (path, read_bytes_bounded(path, limit, DataError,
                                                    f"tokenizer file {path}"))
    if TOKENIZER_JSON not in found and SENTENCEPIECE_MODEL not in found:
        raise DataError(f"tokenizer folder {folder} holds no {TOKENIZER_JSON} or "
                        f"{SENTENCEPIECE_MODEL}; pass the model folder with its tokenizer files, "
                        "a tokenizer.json or a SentencePiece .model file")
    return found


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ids(ids: Iterable[tuple[str, Any]], entries: int, path: Path, where: str) -> None:
    """Every (token, id) of `where` in `path` has an integer id in [0, entries), no id twice:
    ids index the tables a tokenizer library builds, so an id far beyond the number of entries
    costs memory in proportion to the id (an 8 KB file with one id of 2^31 took 8.6 GB)."""
    seen: dict[int, str] = {}
    for token, token_id in ids:
        if not _is_id(token_id) or not 0 <= token_id < entries:
            raise DataError(f"{path}: {where} gives {token!r} the id {token_id!r}, outside "
                            f"[0, {entries}) (the file has {entries} entries); restore the "
                            "tokenizer file the model ships")
        if token_id in seen:
            raise DataError(f"{path}: {where} gives the id {token_id} to both {seen[token_id]!r} "
                            f"and {token!r}; restore the tokenizer file the model ships")
        seen[token_id] = token


def _check_tokenizer_json(text: str, path: Path) -> int:
    """Refuse ids outside the number of entries, or given twice, in a tokenizer.json's
    vocabulary and added tokens, before the tokenizers library reads it; returns the number of
    entries (the bound of every id)."""
    # Its size is bounded (MAX_TOKENIZER_BYTES) and a JSON value takes a byte at least, while a
    # large vocabulary with its merges holds millions of values (Llama 3's 128k ids and 280k
    # merges saved as pairs: 1.1 million).
    document = parse_json(text, DataError, str(path), max_nodes=len(text))
    model = document.get("model") if isinstance(document, dict) else None
    added = document.get("added_tokens") if isinstance(document, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = added if isinstance(added, list) else []
    added = [token for token in added if isinstance(token, dict)]
    entries = (len(vocab) if isinstance(vocab, (dict, list)) else 0) + len(added)
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id (Unigram: a list)
        _check_ids(vocab.items(), entries, path, "model.vocab")
    _check_ids(((token.get("content"), token.get("id")) for token in added), entries, path,
               "added_tokens")
    return entries


def _check_files(files: dict[str, tuple[Path, bytes]]) -> dict[str, Any]:
    """Refuse, in one line naming the file, what is not what its name says, and ids beyond the
    number of entries; return the parsed JSON configs."""
    configs = {}
    entries = 0
    for name, (path, raw) in files.items():
        if name == TOKENIZER_JSON:
            text = decode_utf8(raw, DataError, str(path))
            entries = _check_tokenizer_json(text, path)
            try:
                BackendTokenizer.from_str(text)
            except Exception as err:  # the tokenizers library's parse errors have no common type
                reason = " ".join(str(err).split())[:160]
                raise DataError(f"{path} is not a Hugging Face tokenizer.json ({reason}); pass the "
                                "tokenizer.json a model ships (the tokenizers library's "
                                "serialization)") from None
        elif name == SENTENCEPIECE_MODEL:
            entries = max(entries, load_proto(raw, path).get_piece_size())
        else:
            value = parse_json(decode_utf8(raw, DataError, str(path)), DataError, str(path))
            if not isinstance(value, dict):
                raise DataError(f"{path} holds a JSON {type(value).__name__}, not an object; "
                                "restore the file the model ships")
            configs[name] = value
    _check_added_token_files(files, configs, entries)
    return configs


def _check_added_token_files(files: dict[str, tuple[Path, bytes]], configs: dict[str, Any],
                             entries: int) -> None:
    """The ids tokenizer_config.json's added_tokens_decoder and added_tokens.json name lie
    within the vocabulary plus the tokens they add."""
    decoder = configs.get("tokenizer_config.json", {}).get("added_tokens_decoder")
    if isinstance(decoder, dict):
        def as_id(key: str) -> Any:
            return int(key) if key.isdigit() and len(key) <= 12 else key
        _check_ids(((token.get("content") if isinstance(token, dict) else token, as_id(key))
                    for key, token in decoder.items()), entries + len(decoder),
                   files["tokenizer_config.json"][0], "added_tokens_decoder")
    added = configs.get("added_tokens.json")
    if added:
        _check_ids(added.items(), entries + len(added), files["added_tokens.json"][0],
                   "added_tokens.json")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings (a tokenizer class that does not match, missing TE) say nothing
    the user can act on here."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _build(files: dict[str, tuple[Path, bytes]], source: Path):
    """transformers' tokenizer of `files`, built in a private folder holding only them."""
    with tempfile.TemporaryDirectory(prefix="megamoe-tokenizer-") as sandbox:
        for name, (_, raw) in files.items():
            Path(sandbox, name).write_bytes(raw)
        with _quiet_transformers():
            from transformers import AutoTokenizer

            try:
                return AutoTokenizer.from_pretrained(sandbox, trust_remote_code=False,
                                                     local_files_only=True)
            except Exception as err:  # transformers raises many types for a bad folder
                reason = " ".join(str(err).replace(sandbox, str(source)).split())[:200]
                raise DataError(f"transformers cannot build the tokenizer of {source} "
                                f"({reason}); pass a folder whose tokenizer transformers' "
                                "AutoTokenizer loads without trust_remote_code") from None


def _generation_eos(configs: dict[str, Any]) -> int | None:
    eos = configs.get("generation_config.json", {}).get("eos_token_id")
    if isinstance(eos, list) and eos:
        eos = eos[0]
    return eos if isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0 else None


def _end_of_document(hf, backend: BackendTokenizer, configs: dict[str, Any],
                     source: Path) -> int:
    if hf.eos_token_id is not None:
        return int(hf.eos_token_id)
    eos = _generation_eos(configs)
    if eos is not None:
        return eos
    special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    for token in END_OF_TEXT_TOKENS:
        if token in special:
            return special[token]
    raise DataError(f"tokenizer {source} names no end-of-document token (no eos_token in "
                    "tokenizer_config.json, no eos_token_id in generation_config.json, no "
                    f"special token among {', '.join(END_OF_TEXT_TOKENS)}); put the model's "
                    "tokenizer_config.json with its eos_token beside the tokenizer.json")


def _rule_patterns(serialized: str) -> list[str]:
    """The regular expressions a backend's normalizer and pre-tokenizer run, from its
    serialization (for messages)."""
    rules = json.loads(serialized)
    return [*_patterns(rules.get("normalizer")), *_patterns(rules.get("pre_tokenizer"))]


def _patterns(section: Any) -> Iterator[str]:
    """The regular expressions (`{"Regex": ...}`) anywhere in a serialized backend section."""
    if isinstance(section, dict):
        for key, value in section.items():
            if key == "Regex" and isinstance(value, str):
                yield value
            else:
                yield from _patterns(value)
    elif isinstance(section, list):
        for value in section:
            yield from _patterns(value)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 points to /dev/null meanwhile: the regex engine of `tokenizers` prints
    a Rust backtrace there when it gives up, before Python sees its panic."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _probe_ids(hf, backend: BackendTokenizer, source: Path) -> tuple[list[int], list[int]]:
    """(the backend's ids, transformers' ids) of the load-time probe text; a regex the engine
    gives up on is a one-line DataError."""
    try:
        with _native_stderr_silenced():
            return backend.encode(_PROBE).ids, hf(_PROBE)["input_ids"]
    except BaseException as err:  # noqa: BLE001 - pyo3's PanicException derives from it
        if type(err).__name__ != "PanicException":
            raise
        patterns = ", ".join(repr(p) for p in _rule_patterns(backend.to_str()))
        raise DataError(f"tokenizer {source}: its regex engine gave up on a short probe text "
                        f"({' '.join(str(err).split())}): a regular expression of its "
                        f"normalizer or pre-tokenizer ({patterns}) backtracks without bound; "
                        "fix the pattern") from None


def _announce_custom_class(hf, configs: dict[str, Any], source: Path) -> None:
    """One note on stderr (rank 0) when tokenizer_config.json names a tokenizer class that
    transformers has only with the model's own code: megamoe runs none, so transformers builds
    its generic class over tokenizer.json instead."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    named = configs.get("tokenizer_config.json", {}).get("tokenizer_class")
    if not isinstance(named, str) or tokenizer_class_from_name(named) is not None:
        return
    if os.environ.get("RANK", "0") == "0":
        print(f"note: tokenizer {source}: tokenizer_config.json names the class "
              f"{one_line(named)!r}, whose code is not part of transformers; megamoe runs no code "
              f"from model files and tokenizes with transformers' {type(hf).__name__} over "
              "tokenizer.json", file=sys.stderr, flush=True)


def _plain_backend(serialized: str, split_special_tokens: bool) -> BackendTokenizer:
    """The backend as transformers' __call__ runs it: no truncation, no padding."""
    backend = BackendTokenizer.from_str(serialized)
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = split_special_tokens
    return backend


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face tokenizer: a model folder, or a `tokenizer.json` file on its own."""

    def __init__(self, path: str | os.PathLike) -> None:
        source = Path(path)
        self.path = os.path.abspath(source)
        if source.is_dir():
            files = _read_folder(source)
        else:
            files = {TOKENIZER_JSON: (source, read_bytes_bounded(
                source, MAX_TOKENIZER_BYTES, DataError, f"tokenizer file {source}"))}
        configs = _check_files(files)
        self.kind = "huggingface" if TOKENIZER_JSON in files else "sentencepiece"
        self.files = {p: raw for name, (p, raw) in files.items() if name != MODEL_CONFIG}
        model_type = configs.get(MODEL_CONFIG, {}).get("model_type")
        self.model_type = model_type if isinstance(model_type, str) else None
        self._hf = hf = _build(files, source)
        _announce_custom_class(hf, configs, source)
        self._serialized = hf.backend_tokenizer.to_str()
        self._split_special = bool(getattr(hf, "split_special_tokens", False))
        self._backend = backend = _plain_backend(self._serialized, self._split_special)
        backend_ids, transformers_ids = _probe_ids(hf, backend, source)
        if backend_ids != transformers_ids:
            raise DataError(f"transformers' {type(hf).__name__} for {source} tokenizes beyond "
                            "its tokenizers backend, which megamoe cannot reproduce; report it "
                            "with the model's name")
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(max(vocab.values(), default=-1) + 1, len(hf))
        self.eod = _end_of_document(hf, backend, configs, source)
        self.bos = -1 if hf.bos_token_id is None else int(hf.bos_token_id)
        self.pad = -1 if hf.pad_token_id is None else int(hf.pad_token_id)
        for role, token_id in (("end-of-document (EOS)", self.eod), ("BOS", self.bos),
                               ("pad", self.pad)):
            if token_id >= self.vocab_size:
                raise DataError(f"tokenizer {source}: the {role} id {token_id} lies outside its "
                                f"vocabulary of {self.vocab_size} ids (tokenizer_config.json, "
                                "generation_config.json); restore the files the model ships")
        self.add_bos = self.bos >= 0 and backend.encode("").ids[:1] == [self.bos]
        special = {i: t.content for i, t in backend.get_added_tokens_decoder().items()
                   if t.special}
        backend_rules = json.loads(self._serialized)
        rules = {key: backend_rules.get(key) for key in _RULES}
        self.fingerprint, self.components = fingerprint(
            vocab, special, self.eod, self.bos, self.add_bos, self.pad, self.vocab_size, rules)

    def regexes(self) -> list[str]:
        return _rule_patterns(self._serialized)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOD (transformers' `add_special_tokens=False`)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        """`tokenize` of each text; the tokenizers library picks its own threads (set
        RAYON_NUM_THREADS to bound them), so `num_threads` is not used."""
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of token ids `ids` (transformers' `decode`, special tokens kept)."""
        return self._hf.decode([int(i) for i in ids])

    def encode_document(self, text: str) -> list[int]:
        """`AutoTokenizer(text)["input_ids"]` + [eod]."""
        return self._backend.encode(text).ids + [self.eod]

    def document_encoder(self) -> "HuggingFaceDocuments":
        """`encode_document` of a batch of texts, picklable for worker processes."""
        return HuggingFaceDocuments(self._serialized, self._split_special, self.eod)


class HuggingFaceDocuments:
    """Picklable `encode_document` over a batch (the backend is rebuilt in each process from
    its serialization, once)."""

    def __init__(self, serialized: str, split_special_tokens: bool, eod: int) -> None:
        self.serialized, self.split_special_tokens, self.eod = (serialized,
                                                                split_special_tokens, eod)
        self._backend: BackendTokenizer | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_backend": None}

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        if self._backend is None:
            self._backend = _plain_backend(self.serialized, self.split_special_tokens)
        return [e.ids + [self.eod] for e in self._backend.encode_batch_fast(list(texts))]
