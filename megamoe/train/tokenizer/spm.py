"""SentencePiece tokenizers: train one from text, and read a `.model` file with the sentencepiece
library (megamoe's own tokenizers; a model folder's `tokenizer.model` is read the way transformers
reads it, by `hf.HuggingFaceTokenizer`).

Trained models are lossless (SentencePiece, arXiv:1808.06226, with byte fallback): no text
normalisation, whitespace and newlines kept, so `detokenize(tokenize(text)) == text` for any
UTF-8 text. The end-of-document (EOD) token is SentencePiece's `</s>` (id 2 in trained models).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import sentencepiece as spm

from megamoe.bounded import read_bytes_bounded
from megamoe.errors import DataError
from megamoe.train.tokenizer.base import Tokenizer, fingerprint

MAX_MODEL_BYTES = 256 << 20  # the largest released tokenizer.model files are ~5 MB

MODEL_TYPES = ("bpe", "unigram")

# Options of every model this module trains; the ids are SentencePiece's defaults, written out so
# that EOD is always id 2.
_TRAINER_OPTIONS = dict(
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    character_coverage=0.9995,
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    minloglevel=2,
)


def train_sentencepiece(
    lines: Iterable[str], vocab_size: int, model_type: str = "bpe", num_threads: int = 2
) -> bytes:
    """Train a SentencePiece model (arXiv:1808.06226) of `vocab_size` pieces on `lines`.

    Each element of `lines` is one training sentence (SentencePiece skips sentences over 4192
    bytes). Training is deterministic for a given sequence of lines. Returns the serialized
    model, ready to be written to a `.model` file.
    """
    if model_type not in MODEL_TYPES:
        raise DataError(f"unknown tokenizer model type {model_type!r}; use one of {MODEL_TYPES}")
    seen = 0
    failures: list[BaseException] = []

    def guarded() -> Iterator[str]:
        # sentencepiece turns an exception inside the iterator into a RuntimeError: keep it.
        nonlocal seen
        try:
            for line in lines:
                seen += 1
                yield line
        except BaseException as err:
            failures.append(err)
            raise

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=guarded(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            num_threads=num_threads,
            **_TRAINER_OPTIONS,
        )
    except RuntimeError as err:
        if failures:
            raise failures[0] from None
        if seen == 0:
            raise DataError("no text to train the tokenizer on; the inputs are empty") from None
        reason = " ".join(str(err).split())
        raise DataError(
            f"cannot train a {vocab_size}-piece tokenizer on this corpus ({reason}); "
            "choose another --vocab-size or a larger corpus"
        ) from None
    return model.getvalue()


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (`.model` file) read with the sentencepiece library.

    Documents are written as `[bos if add_bos] + encode(text) + [eos]`: the end-of-document id
    is the model's `</s>`; megamoe's own models add no BOS (`add_bos=False`).
    """

    kind = "sentencepiece"

    def __init__(self, model_path: str | os.PathLike, add_bos: bool = False) -> None:
        self.path = self.model_path = os.path.abspath(model_path)
        proto = read_bytes_bounded(self.path, MAX_MODEL_BYTES, DataError,
                                   f"tokenizer model {model_path}")
        self._sp = load_proto(proto, model_path)
        self.files = {Path(self.path): proto}
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        self.bos = self._sp.bos_id()
        self.pad = self._sp.pad_id()
        self.add_bos = bool(add_bos) and self.bos >= 0
        sp = self._sp
        self.fingerprint, self.components = fingerprint(
            {sp.id_to_piece(i): i for i in range(self.vocab_size)},
            {i: sp.id_to_piece(i) for i in range(self.vocab_size)
             if sp.is_control(i) or sp.is_unknown(i)},
            self.eod, self.bos, self.add_bos, self.pad, self.vocab_size)
        self._proto = proto

    @property
    def eos(self) -> int:
        """End-of-sentence id (the same piece as `eod`)."""
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOD."""
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        """Token ids of each text in `texts`, encoded on `num_threads` threads."""
        return self._sp.encode(texts, num_threads=num_threads)

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of token ids `ids`."""
        return self._sp.decode([int(i) for i in ids])

    def encode_document(self, text: str) -> list[int]:
        """[bos if add_bos] + tokenize(text) + [eod]."""
        return _document(self._sp.encode(text), self.bos if self.add_bos else -1, self.eod)

    def document_encoder(self) -> "SentencePieceDocuments":
        """`encode_document` of a batch of texts, picklable for worker processes."""
        return SentencePieceDocuments(self._proto, self.bos if self.add_bos else -1, self.eod)


def load_proto(proto: bytes, name: str | os.PathLike) -> spm.SentencePieceProcessor:
    """The SentencePiece processor of the serialized model `proto` read from `name`."""
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except RuntimeError:
        raise DataError(
            f"{name} is not a SentencePiece model (nor a Hugging Face tokenizer.json); pass a "
            ".model file, a tokenizer.json or a model folder holding one"
        ) from None
    if sp.eos_id() < 0:
        raise DataError(
            f"tokenizer {name} has no end-of-sentence piece to use as end-of-document; "
            "train it with eos_id >= 0"
        )
    return sp


def _document(ids: list[int], bos: int, eod: int) -> list[int]:
    return ([bos] if bos >= 0 else []) + ids + [eod]


class SentencePieceDocuments:
    """Picklable `encode_document` over a batch (the processor is rebuilt in each process from
    the serialized model, once)."""

    def __init__(self, proto: bytes, bos: int, eod: int) -> None:
        self.proto, self.bos, self.eod = proto, bos, eod
        self._sp: spm.SentencePieceProcessor | None = None

    def __getstate__(self) -> dict:
        return {"proto": self.proto, "bos": self.bos, "eod": self.eod, "_sp": None}

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        if self._sp is None:
            self._sp = load_proto(self.proto, "tokenizer model")
        ids = self._sp.encode(list(texts), num_threads=1)  # worker processes run in parallel
        return [_document(doc, self.bos, self.eod) for doc in ids]
