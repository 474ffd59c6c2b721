"""SentencePiece tokenizer: train one from text, and load one in the shape Megatron's datasets read.

Trained models are lossless (SentencePiece, arXiv:1808.06226, with byte fallback): no text
normalisation, whitespace and newlines kept, so `detokenize(tokenize(text)) == text` for any
UTF-8 text. The end-of-document (EOD) token is SentencePiece's `</s>` (id 2 in trained models).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections import OrderedDict
from typing import Iterable, Iterator

import sentencepiece as spm

from megamoe.errors import DataError

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


class SentencePieceTokenizer:
    """A SentencePiece model with the attributes Megatron-Core's GPT datasets read.

    `GPTDatasetConfig` needs `vocab_size`, `eod` (to build loss masks and position ids), `pad`
    (-1 when the model has no pad piece: Megatron then uses its own -1 sentinel) and
    `unique_identifiers` (hashed into the name of Megatron's index cache, so a different model
    file gives different cache entries).
    """

    def __init__(self, model_path: str | os.PathLike) -> None:
        self.model_path = os.path.abspath(model_path)
        try:
            with open(self.model_path, "rb") as f:
                proto = f.read()
        except OSError as err:
            raise DataError(
                f"cannot read tokenizer model {model_path} ({err.strerror}); pass the .model file "
                "written by tools/preprocess_data.py --train-tokenizer"
            ) from None
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(proto)
        except RuntimeError:
            raise DataError(
                f"{model_path} is not a SentencePiece model; pass a .model file written by "
                "sentencepiece or tools/preprocess_data.py --train-tokenizer"
            ) from None
        if self._sp.eos_id() < 0:
            raise DataError(
                f"tokenizer {model_path} has no end-of-sentence piece to use as end-of-document; "
                "train it with eos_id >= 0"
            )
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("tokenizer_path", [self.model_path]),
                ("sha256", hashlib.sha256(proto).hexdigest()),
            ]
        )

    @property
    def vocab_size(self) -> int:
        """Number of pieces; every token id is below it."""
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        """End-of-document id, appended after every document."""
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        """End-of-sentence id (the same piece as `eod`)."""
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        """Beginning-of-sentence id (-1 if the model has none)."""
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        """Padding id (-1 if the model has none)."""
        return self._sp.pad_id()

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOD."""
        return self._sp.encode(text)

    def tokenize_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        """Token ids of each text in `texts`, encoded on `num_threads` threads."""
        return self._sp.encode(texts, num_threads=num_threads)

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of token ids `ids`."""
        return self._sp.decode([int(i) for i in ids])
