"""The checkpoint readers behind one small registry: a format name, how to recognise it, how to
open it.

Every reader yields global (tensor-parallel merged) tensors one layer at a time through the
interface of `megamoe.checkpointing.source.DenseSource`; all of them load pickles only through
megamoe's allow-lists. A new format is one module plus one `READERS` line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megamoe.bounded import read_json
from megamoe.checkpointing.deepspeed_source import DeepSpeedSource, is_deepspeed_checkpoint
from megamoe.checkpointing.dist_source import DistSource
from megamoe.checkpointing.hf_source import HFSource, is_hf_directory
from megamoe.checkpointing.legacy_source import LegacySource
from megamoe.checkpointing.source import DenseSource, has_rank_dirs, resolve_checkpoint_dir
from megamoe.errors import CheckpointError
from megamoe.paths import inside


@dataclass(frozen=True)
class Reader:
    recognises: Callable[[Path], bool]
    """True when the directory holds a checkpoint of this format."""
    opens: Callable[[Path], DenseSource]
    dense: bool
    """Read as an upcycling source (False: an MoE checkpoint the importers read)."""


def _is_torch_dist(directory: Path) -> bool:
    if not (directory / "metadata.json").exists():
        return False
    metadata = read_json(inside(directory, "metadata.json"), 1 << 16, CheckpointError)
    backend = metadata.get("sharded_backend") if isinstance(metadata, dict) else None
    if not isinstance(backend, str):
        raise CheckpointError(f"{directory}/metadata.json is not Megatron checkpoint "
                              "metadata; the checkpoint is corrupt")
    if backend != "torch_dist":
        raise CheckpointError(f"{directory} is a {backend!r} distributed checkpoint; only "
                              "torch_dist is supported (convert it with Megatron first)")
    return True


READERS: dict[str, Reader] = {
    "hf_safetensors": Reader(is_hf_directory, HFSource, dense=True),
    "torch_dist": Reader(_is_torch_dist, DistSource, dense=True),
    "legacy": Reader(has_rank_dirs, LegacySource, dense=True),
    "deepspeed": Reader(is_deepspeed_checkpoint, DeepSpeedSource, dense=False),
}


def open_dense_checkpoint(path) -> DenseSource:
    """Detect the format of the dense checkpoint at `path` and open it for layer-by-layer
    reading: a Hugging Face model directory, or a Megatron-LM checkpoint (its root, or one
    checkpoint folder; see `megamoe.checkpointing.source`)."""
    path = Path(path)
    if READERS["hf_safetensors"].recognises(path):
        return READERS["hf_safetensors"].opens(path)
    directory = resolve_checkpoint_dir(path)
    for reader in READERS.values():
        if reader.dense and reader.recognises(directory):
            return reader.opens(directory)
    raise CheckpointError(f"unknown checkpoint format in {directory}: neither metadata.json "
                          "(torch_dist) nor mp_rank_*/model_optim_rng.pt (legacy)")


def open_checkpoint(path, format: str) -> DenseSource:
    """Open the checkpoint at `path` with the reader of `format` (a `READERS` name)."""
    return READERS[format].opens(Path(path))
