"""What every tokenizer megamoe reads offers: the ids a document is written as, and an identity
that names the vocabulary independently of the files it came from."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Sequence

# A batch of documents -> the ids each is written as (BOS when the model adds one, text, EOD).
DocumentEncoder = Callable[[Sequence[str]], list[list[int]]]


def _digest(value) -> str:
    """Hex sha256 of the canonical JSON of `value`."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# What decides a text's ids and its document's ends, by name: what data compatibility compares.
ID_COMPONENTS = ("vocabulary", "normalizer", "pre_tokenizer", "merges", "post_processor", "bos",
                 "eod")


def fingerprint(vocab: dict[str, int], special: dict[int, str], eod: int, bos: int,
                add_bos: bool, pad: int, vocab_size: int,
                rules: dict | None = None) -> tuple[str, dict[str, str]]:
    """(fingerprint, components) of a tokenizer.

    The fingerprint is the hex sha256 of a canonical JSON of the vocabulary (token -> id), the
    special tokens (id -> text), the ids a document is built with and `rules`, what else decides
    how text is cut into those tokens (a Hugging Face backend's normalizer, pre-tokenizer, model
    with its merges, post-processor): equal for two tokenizers exactly when they give every text
    the same ids and start, end and pad documents alike, whatever the files (JSON layout, a
    SentencePiece proto or a tokenizer.json) they were read from.

    The components are the digests of its parts that decide token ids and document ends
    (`ID_COMPONENTS`, those present): the pad id, which Megatron never feeds the loss, is not
    one, so data made with a model folder suits the same model's tokenizer.json alone."""
    payload = {
        "vocab": sorted(vocab.items(), key=lambda item: (item[1], item[0])),
        "special": sorted(special.items()),
        "eod": eod, "bos": bos, "add_bos": add_bos, "pad": pad, "vocab_size": vocab_size,
        "rules": rules,
    }
    components = {"vocabulary": _digest([payload["vocab"], payload["special"], vocab_size])}
    if rules is not None:
        model = {key: value for key, value in (rules.get("model") or {}).items() if key != "vocab"}
        components.update(normalizer=_digest(rules.get("normalizer")),
                          pre_tokenizer=_digest(rules.get("pre_tokenizer")),
                          merges=_digest(model),
                          post_processor=_digest(rules.get("post_processor")))
    components.update(bos=_digest([bos, add_bos]), eod=_digest(eod))
    return _digest(payload), components


class Tokenizer:
    """The attributes Megatron-Core's GPT datasets read (`vocab_size`, `eod`, `pad`,
    `unique_identifiers`) and those megamoe's data, checkpoints and exports share.

    Subclasses set, in `__init__`: `kind` ("huggingface" | "sentencepiece"), `path` (absolute),
    `vocab_size` (every id it emits is below it), `eod` (appended after each document), `bos`
    and `pad` (-1 when there is none; `pad` may equal `eod` and is never used for masking),
    `add_bos` (whether a document starts with `bos`, the model's own rule), `files` (what makes
    up the tokenizer: each file's path and the bytes that were loaded from it, which are what
    copies and checkpoints write, whatever happens to the path later), `fingerprint` and
    `components` (`base.fingerprint`); and implement `tokenize`,
    `tokenize_batch`, `detokenize`, `encode_document` and `document_encoder`.
    """

    kind: str
    path: str
    vocab_size: int
    eod: int
    bos: int
    add_bos: bool
    pad: int
    files: dict[Path, bytes]
    fingerprint: str
    components: dict[str, str]
    # The model_type of the model folder it came from: transformers chooses the tokenizer class
    # (and so how text is cut) by it, so a copy of the tokenizer keeps it.
    model_type: str | None = None

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Hashed by Megatron-Core into its index cache names: one entry per vocabulary."""
        return OrderedDict([("class", type(self).__name__), ("tokenizer_path", [self.path]),
                            ("fingerprint", self.fingerprint)])

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOD."""
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        """`tokenize` of each text in `texts`, on up to `num_threads` threads."""
        raise NotImplementedError

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of token ids `ids`."""
        raise NotImplementedError

    def document_encoder(self) -> DocumentEncoder:
        """A picklable function (for worker processes) of a batch of texts giving
        `encode_document` of each."""
        raise NotImplementedError

    def encode_document(self, text: str) -> list[int]:
        """The ids `text` is written as in a dataset: [BOS when the model adds one] + its tokens
        + [EOD]."""
        raise NotImplementedError

    def regexes(self) -> list[str]:
        """The regular expressions its normalizer and pre-tokenizer run (for messages)."""
        return []

    def describe(self) -> str:
        """A short description for messages."""
        return (f"{self.path} ({self.vocab_size} ids, eod {self.eod}, "
                f"fingerprint {self.fingerprint[:12]})")
