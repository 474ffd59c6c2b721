"""The run's training batches: the data of `data.prefixes` or the default corpus, sized to the
run (train_steps x global_batch_size samples), dealt to data-parallel ranks and resumable at any
consumed-sample count (megamoe.train.data).

The tokenizer is `data.tokenizer` (or, for the default corpus without one, the corpus's own),
and the data must be its token ids: a dataset made by megamoe records its tokenizer beside it
(`PREFIX.tokenizer-identity.json`), which must be the configured one; a dataset made elsewhere
(Megatron-LM's preprocess_data.py) is checked for ids beyond the vocabulary and documents that
do not end in the tokenizer's end-of-document id (megamoe.train.indexed_check).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from megamoe.errors import DataError
from megamoe.train.config import TrainConfig
from megamoe.train.corpus import ensure_default_dataset
from megamoe.train.data import Batch, build_gpt_datasets, iterate_batches
from megamoe.train.indexed_check import check_indexed_dataset
from megamoe.train.tokenizer import (Tokenizer, describe_identity, load_tokenizer,
                                     read_dataset_identity)
from megamoe.train.tokenizer.base import ID_COMPONENTS


NO_RECORD = "no tokenizer record: ids range-checked only"


def _differing(record: dict, tokenizer: Tokenizer) -> list[str] | None:
    """The components (vocabulary, merges, ...) in which the recorded tokenizer and `tokenizer`
    differ, or None when the record predates components (then only its fingerprint tells)."""
    if "components" not in record:
        return None
    recorded, loaded = record["components"], tokenizer.components
    return [name for name in ID_COMPONENTS if recorded.get(name) != loaded.get(name)]


def check_data_tokenizer(prefix: str, tokenizer: Tokenizer) -> str | None:
    """Raise a one-line DataError unless the dataset `prefix` holds token ids of `tokenizer`:
    its recorded tokenizer decides ids and document ends as `tokenizer` does (vocabulary,
    merges, normalizer, pre-tokenizer, BOS and EOD; a pad token may differ), or (no record) its
    ids are below the vocabulary and its documents end in the end-of-document id; then it
    returns `NO_RECORD`, for the run to say so."""
    record = read_dataset_identity(prefix)
    if record is None:
        check_indexed_dataset(prefix, tokenizer.vocab_size, tokenizer.eod, tokenizer.describe())
        return NO_RECORD
    differing = _differing(record, tokenizer)
    if record["fingerprint"] != tokenizer.fingerprint and differing != []:
        which = f" (they differ in {', '.join(differing)})" if differing else ""
        raise DataError(f"{prefix} was made with tokenizer {describe_identity(record)} but "
                        f"data.tokenizer is {tokenizer.describe()}{which}; set data.tokenizer "
                        "to the tokenizer the data was made with, or rebuild the data with "
                        f"tools/preprocess_data.py --tokenizer {tokenizer.path}")
    check_indexed_dataset(prefix, tokenizer.vocab_size)
    return None


def data_sources(config: TrainConfig) -> tuple[list[str], Tokenizer, list[str]]:
    """(dataset prefixes, tokenizer, the prefixes without a tokenizer record) of the run,
    checked to belong together. The default corpus is built once (tokenized with
    `data.tokenizer` when given, else with its own SentencePiece model), by global rank 0 first
    (the others then find it, or build their own on a node-local cache)."""
    data = config.data
    tokenizer = load_tokenizer(Path(data.tokenizer).expanduser()) if data.tokenizer else None
    if data.prefixes:
        prefixes = [str(Path(p).expanduser()) for p in data.prefixes]
        # before the run writes anything
        unrecorded = [prefix for prefix in prefixes if check_data_tokenizer(prefix, tokenizer)]
        return prefixes, tokenizer, unrecorded
    cache = Path(data.cache_dir).expanduser()
    if dist.get_rank() == 0:
        prefix, model = ensure_default_dataset(cache, data.vocab_size, tokenizer=tokenizer)
    dist.barrier()
    if dist.get_rank() != 0:
        prefix, model = ensure_default_dataset(cache, data.vocab_size, progress=False,
                                               tokenizer=tokenizer)
    return [prefix], tokenizer or load_tokenizer(model), []


def training_batches(config: TrainConfig, prefixes: list[str], tokenizer: Tokenizer,
                     dp_rank: int, dp_size: int, start_sample: int) -> Iterator[Batch]:
    """This data-parallel rank's micro-batches from global sample `start_sample` on. The
    dataset holds `guards.max_rollbacks` steps more than the run trains, for the batches a
    loss-spike rollback skips."""
    data, training = config.data, config.training
    steps = training.train_steps + config.guards.max_rollbacks
    train, _, _ = build_gpt_datasets(
        prefixes, tokenizer, seq_length=config.model.seq_length, seed=training.seed,
        num_samples=(steps * training.global_batch_size, None, None),
        index_cache_dir=Path(data.cache_dir).expanduser() / "index", split=data.split,
        weights=data.weights, eod_mask_loss=data.eod_mask_loss)
    return iterate_batches(train, micro_batch_size=training.micro_batch_size, dp_rank=dp_rank,
                           dp_size=dp_size, start_sample=start_sample,
                           num_workers=data.num_workers)
