"""The `data` section: Megatron indexed datasets or the built-in default corpus, and the
reading of its split and blend weights."""
from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field
from typing import Optional

from megamoe.errors import ConfigError
from megamoe.settings import check_fields, shown
from megamoe.train.settings.checks import require


@dataclass
class DataConfig:
    """Training data: Megatron indexed datasets, or the built-in default corpus."""

    prefixes: list[str] = field(default_factory=list)
    """PREFIX of PREFIX.bin/.idx files (tools/preprocess_data.py); empty: the default corpus
    (Python standard library prose, built once under `cache_dir`)."""
    weights: Optional[list[float]] = None
    """Blend weights, one per prefix (None: one pass over each)."""
    tokenizer: Optional[str] = None
    """The tokenizer of the data (megamoe.train.tokenizer.load_tokenizer): a SentencePiece
    `.model`, a Hugging Face `tokenizer.json` or a folder holding one. Required with `prefixes`
    (whose `PREFIX.tokenizer-identity.json` it must match); without `prefixes` the default corpus
    is tokenized with it. `data.tokenizer_model` (older configs) is read as this key."""
    cache_dir: str = "~/.cache/megamoe"
    """Where the default corpus and the dataset index caches live (shared by all ranks)."""
    split: str = "100,0,0"
    """train/valid/test document split weights."""
    vocab_size: int = 4096
    """Vocabulary size. Without `tokenizer`: the size the default corpus's tokenizer is trained
    to. With `tokenizer` the trainer takes the tokenizer's own size (or the embedding rows of
    the checkpoint it starts from, when they are more), and this value says
    what that size is where the tokenizer is not at hand: the memory planner
    (`tools/plan_memory.py`) counts the embedding and output layer with it (the recipes set
    their model's vocabulary here)."""
    num_workers: int = 0
    """Data loader worker processes per rank."""
    eod_mask_loss: bool = False
    """Megatron's eod_mask_loss: positions whose input is the end-of-document token do not count
    in the loss (the next document's first token is not predicted across the boundary). Off,
    every position counts, the end of each document included, whatever the tokenizer's pad."""

    def __post_init__(self) -> None:
        check_fields(self, "data")
        require(bool(self.tokenizer) or not self.prefixes,
                "data.prefixes needs data.tokenizer, the tokenizer the data was made with (a "
                "SentencePiece .model, a tokenizer.json or a Hugging Face folder)")
        require(self.num_workers >= 0, f"data.num_workers={self.num_workers} must be >= 0")
        require(self.vocab_size >= 100, f"data.vocab_size={self.vocab_size} must be >= 100")
        require(split_weights(self.split)[0] > 0, f"data.split={self.split!r} gives the train "
                "split no weight; e.g. data.split=98,2,0")
        if self.weights is not None:
            check_blend_weights(self.weights, len(self.prefixes))


def split_weights(split: str) -> list[float]:
    """`data.split` ("98,2,0", or with "/") as its train, valid and test weights (those left
    out are 0), normalised to sum 1. ConfigError unless it holds one to three non-negative
    decimals of finite, non-zero sum."""
    parts = re.split(r"[,/]", split)
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\d+(\.\d*)?", part.strip())
                                            for part in parts):
        raise ConfigError(f"data.split={shown(repr(split))} must be one to three "
                          "comma-separated non-negative decimal train,valid,test weights, "
                          "e.g. 98,2,0")
    weights = [float(part) for part in parts] + [0.0] * (3 - len(parts))
    total = sum(weights)
    if not 0 < total < math.inf:
        raise ConfigError(f"data.split={shown(repr(split))} must give the splits a finite, "
                          "non-zero total weight, e.g. 98,2,0")
    return [weight / total for weight in weights]


def check_blend_weights(weights: typing.Sequence[float], prefixes: int) -> None:
    """`data.weights`: one positive weight per data prefix, of finite sum (Megatron-Core
    normalises them by their sum)."""
    if len(weights) != prefixes or not all(0 < weight for weight in weights) \
            or not math.isfinite(sum(weights)):
        raise ConfigError(f"data.weights={list(weights)} must be {prefixes} positive weight(s) "
                          "of finite sum, one per data.prefixes entry, or null")
