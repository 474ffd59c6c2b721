"""Training batches from Megatron indexed datasets, through megatron-core's own GPT dataset classes.

`build_gpt_datasets` builds the train/valid/test datasets of a data prefix or a weighted blend of
prefixes with `BlendedMegatronDatasetBuilder` + `GPTDatasetConfig` + `GPTDataset`: documents are
shuffled and packed into `seq_length + 1`-token samples, deterministically for a seed, and the
shuffle indices are cached in `index_cache_dir`. Under torch.distributed it must be called on
every rank: global rank 0 builds the indices first, the others then read them from the cache
(so the cache directory must be visible to all ranks). It also works without torch.distributed.
Runs that share a cache (a sweep's jobs on one data set) take turns at it: Megatron-Core writes
an index in place and reads any index it finds, so a run starting while another writes the same
one would read half a file; each run's rank 0 holds an exclusive lock on the cache folder while
it builds or reads (`_cache_lock`), and its other ranks read only after it.
Loss masks are Megatron's: every position counts except, with `eod_mask_loss`, those whose input
is an end of document. A tokenizer's pad id never masks anything (`DatasetTokenizer`).

`iterate_batches` deals the samples to data-parallel ranks the way Megatron's pretraining sampler
does: global sample g belongs to micro step g // (micro_batch_size * dp_size) and to rank
(g % (micro_batch_size * dp_size)) // micro_batch_size. Resuming from `start_sample` (the samples
the whole data-parallel group already consumed) therefore continues exactly where a run stopped.

Shapes: B micro batch size, S sequence length.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from torch.utils.data import DataLoader, Dataset

from megamoe.errors import ConfigError, DataError, MegaMoEError
from megamoe.megatron import compat
from megamoe.train.settings.data import check_blend_weights, split_weights
from megamoe.train.indexed_check import check_indexed_dataset
from megamoe.train.tokenizer import Tokenizer

SPLIT_NAMES = ("train", "valid", "test")


class Batch(NamedTuple):
    """One micro batch for a causal language model; every field is [B, S]."""

    tokens: torch.Tensor  # int64 input ids
    labels: torch.Tensor  # int64 next-token targets (tokens shifted left by one)
    loss_mask: torch.Tensor  # float32, 0 where a position must not count in the loss
    position_ids: torch.Tensor  # int64


class DatasetTokenizer:
    """What Megatron-Core's GPTDataset reads of a tokenizer: `vocab_size`, `eod`,
    `unique_identifiers` (hashed into its index cache names) and `pad`.

    `pad` is always Megatron's own sentinel -1, which no data holds: GPTDataset (megatron-core
    0.16 and 0.19, `__getitem__`) sets the loss mask to 0 wherever a label equals the pad id
    and replaces those tokens and labels by 0, so a pad equal to the end of document (Qwen,
    DeepSeek) would stop every document end from being learned (Megatron-LM PR #2017; both
    versions then fall back to -1 themselves, with a warning, only when they recognise the
    collision and `allow_ambiguous_pad_tokens` is off). Pretraining samples are packed, never
    padded, except the last sample of a split, which Megatron pads with the sentinel and masks.
    """

    pad = -1

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.vocab_size, self.eod = tokenizer.vocab_size, tokenizer.eod
        self.unique_identifiers = tokenizer.unique_identifiers


def _require_helpers() -> None:
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        raise MegaMoEError(
            "megatron-core lacks its compiled dataset helpers "
            "(megatron.core.datasets.helpers_cpp); reinstall it from a wheel, or from source "
            "with a C++ compiler and pybind11 present"
        )


def _check_blend(
    prefixes: Sequence[str],
    weights: Optional[Sequence[float]],
    split: str,
    split_matrix: list,
    num_samples: Sequence[Optional[int]],
    vocab_size: Optional[int] = None,
) -> None:
    if not prefixes:
        raise ConfigError("no data prefix given; pass the PREFIX of PREFIX.bin/PREFIX.idx")
    if weights is not None:
        check_blend_weights(weights, len(prefixes))
    for name, bounds, size in zip(SPLIT_NAMES, split_matrix, num_samples):
        if bounds is not None and size is None and weights is not None:
            raise ConfigError(f"a weighted blend needs a {name} sample count; pass num_samples")
    for prefix in prefixes:
        if not IndexedDataset.exists(prefix):
            raise DataError(
                f"no indexed dataset at {prefix} ({prefix}.bin/.idx); build it with "
                "tools/preprocess_data.py"
            )
        check_indexed_dataset(prefix, vocab_size)
        indexed = IndexedDataset(prefix)  # keep it alive: its lengths view its memory map
        lengths = indexed.sequence_lengths
        for name, bounds in zip(SPLIT_NAMES, split_matrix):
            # megatron's builder rounds the same way, and loops forever on a split without tokens
            if bounds is not None:
                begin, end = (int(round(b * len(lengths))) for b in bounds)
                if lengths[begin:end].sum() == 0:
                    raise DataError(
                        f"split {split!r} leaves the {name} split of {prefix} without documents "
                        f"({len(lengths)} in total); give {name} a larger share or add data"
                    )


def build_gpt_datasets(
    prefixes: Sequence[str],
    tokenizer: Tokenizer,
    *,
    seq_length: int,
    seed: int,
    num_samples: Sequence[Optional[int]],
    index_cache_dir: str | os.PathLike,
    split: str = "98,2,0",
    weights: Optional[Sequence[float]] = None,
    eod_mask_loss: bool = False,
) -> list[Optional[Dataset]]:
    """Build the (train, valid, test) GPT datasets of `prefixes`, blended by `weights`.

    `num_samples` holds the number of samples each split must provide (None: one pass over its
    documents; required for every split when `weights` is given). `split` divides every prefix's
    documents into train/valid/test by weight. A split with zero weight is returned as None.
    Samples are dicts with tokens, labels, loss_mask and position_ids of `seq_length` entries.
    """
    _require_helpers()
    if seq_length < 1:
        raise ConfigError(f"seq_length {seq_length} must be at least 1")
    if len(num_samples) != 3 or any(n is not None and n < 0 for n in num_samples):
        raise ConfigError(
            f"num_samples {list(num_samples)} must be (train, valid, test) counts or None"
        )
    prefixes = [str(p) for p in prefixes]
    split_matrix = convert_split_vector_to_split_matrix(split_weights(split))
    _check_blend(prefixes, weights, split, split_matrix, num_samples, tokenizer.vocab_size)
    # megatron wants a size for every split of a weighted blend, even for splits it skips
    sizes = [0 if bounds is None else n for bounds, n in zip(split_matrix, num_samples)]
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, None if weights is None else [float(w) for w in weights]),
        split=split,
        path_to_cache=str(index_cache_dir),
        tokenizer=DatasetTokenizer(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    builder = BlendedMegatronDatasetBuilder(
        cls=GPTDataset, sizes=sizes, is_built_on_rank=lambda: True, config=config
    )
    with compat.process_group_for_dataset_build(), _cache_lock(index_cache_dir):
        return builder.build()


@contextlib.contextmanager
def _cache_lock(index_cache_dir: str | os.PathLike) -> Iterator[None]:
    """On global rank 0 (the rank that writes the index cache), an exclusive lock on the cache
    folder for as long as it is held (see the module docstring); nothing on the other ranks,
    which read the cache after rank 0 (Megatron's build waits for it), nor where the folder
    cannot be written (no run can write its indices either)."""
    if torch.distributed.get_rank() != 0:
        yield
        return
    try:
        os.makedirs(index_cache_dir, exist_ok=True)
        lock = open(os.path.join(index_cache_dir, ".megamoe-build.lock"), "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _rank_sample_indices(
    total: int, micro_batch_size: int, dp_rank: int, dp_size: int, start_sample: int
) -> Iterator[list[int]]:
    """Sample indices of each of this rank's micro batches; stops before an incomplete step."""
    step = micro_batch_size * dp_size
    first = start_sample
    while first + step <= total:
        begin = first + dp_rank * micro_batch_size
        yield list(range(begin, begin + micro_batch_size))
        first += step


def _collate(samples: list[dict]) -> Batch:
    return Batch(*(torch.stack([sample[key] for sample in samples]) for key in Batch._fields))


def iterate_batches(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    start_sample: int = 0,
    num_workers: int = 0,
    collate: Callable[[list[dict]], Any] = _collate,
) -> Iterator[Batch]:
    """Yield this data-parallel rank's micro batches of `dataset` (samples put together by
    `collate`), starting at global sample `start_sample`, until fewer than
    `micro_batch_size * dp_size` samples remain.

    Every rank yields the same number of batches; `num_workers` loader processes prefetch them.
    """
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ConfigError(
            f"micro_batch_size {micro_batch_size}, dp_rank {dp_rank}, dp_size {dp_size}: need "
            "micro_batch_size >= 1 and 0 <= dp_rank < dp_size"
        )
    if not 0 <= start_sample <= len(dataset):
        raise DataError(
            f"start sample {start_sample} is outside the dataset's {len(dataset)} samples; "
            "build the dataset with enough train samples for the resumed run"
        )
    indices = _rank_sample_indices(len(dataset), micro_batch_size, dp_rank, dp_size, start_sample)
    # A DataLoader draws its workers' base seed from the generator it is given (else the
    # default one, which would shift every later draw of a resumed run: dropout, SIMoE's masks).
    loader = DataLoader(
        dataset, batch_sampler=indices, num_workers=num_workers, collate_fn=collate,
        generator=torch.Generator().manual_seed(start_sample),
    )
    return iter(loader)
