"""The run's training batches: the data of `data.prefixes` or the default corpus, sized to the
run (train_steps x global_batch_size samples), dealt to data-parallel ranks and resumable at any
consumed-sample count (megamoe.train.data)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from megamoe.train.config import TrainConfig
from megamoe.train.corpus import ensure_default_dataset
from megamoe.train.data import Batch, build_gpt_datasets, iterate_batches
from megamoe.train.indexed_check import check_indexed_dataset
from megamoe.train.tokenizer import SentencePieceTokenizer


def data_sources(config: TrainConfig) -> tuple[list[str], str]:
    """(dataset prefixes, tokenizer model) of the run. The default corpus is built once, by
    global rank 0 first (the others then find it, or build their own on a node-local cache)."""
    data = config.data
    if data.prefixes:
        prefixes = [str(Path(p).expanduser()) for p in data.prefixes]
        model = str(Path(data.tokenizer_model).expanduser())
        vocab_size = SentencePieceTokenizer(model).vocab_size
        for prefix in prefixes:  # before the run writes anything
            check_indexed_dataset(prefix, vocab_size)
        return prefixes, model
    cache = Path(data.cache_dir).expanduser()
    if dist.get_rank() == 0:
        prefix, model = ensure_default_dataset(cache, data.vocab_size)
    dist.barrier()
    if dist.get_rank() != 0:
        prefix, model = ensure_default_dataset(cache, data.vocab_size, progress=False)
    return [prefix], model


def training_batches(config: TrainConfig, prefixes: list[str], tokenizer: SentencePieceTokenizer,
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
