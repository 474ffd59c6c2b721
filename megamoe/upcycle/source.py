"""A dense Megatron-Core GPT checkpoint, whatever its format: format detection and the common
interface the converter reads through.

Both readers return global (tensor-parallel merged) tensors keyed by Megatron's sharded-key
suffix within a layer (e.g. `self_attention.linear_qkv.weight`, `mlp.linear_fc1.weight`,
`mlp.linear_fc1.layer_norm_weight`), one layer at a time.

Accepted paths: a Hugging Face model directory (`config.json` + safetensors, read by
megamoe.interop.hf_source), a Megatron-LM checkpoint root (`latest_checkpointed_iteration.txt` names the
iteration), a root holding `iter_*` directories (the latest is taken), or one checkpoint
directory: torch_dist (`metadata.json` + `.metadata` + `*.distcp`) or legacy per-rank files
(`mp_rank_XX[_YYY]/model_optim_rng.pt`).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Protocol

import torch

from megamoe.bounded import read_json
from megamoe.errors import CheckpointError
from megamoe.paths import inside
from megamoe.upcycle.layout import ObjectItem

MOE_MARKERS = (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class DenseLayer:
    """One transformer layer: global tensors and serialized sharded objects by key suffix."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, bytes] = field(default_factory=dict)


class DenseSource(Protocol):
    format: str
    """`torch_dist`, `legacy` or `hf_safetensors`."""
    description: str
    """One line for logs and the recipe: format, layout and path."""
    num_layers: int
    args: Optional[argparse.Namespace]
    """Megatron-LM's saved arguments, when the checkpoint has them."""
    key_layout: str
    """torch_dist: `stacked`, `per_layer` or `singleton`; legacy: `module` (state_dict keys)."""
    model_settings: Optional[dict]
    """The megamoe training config's `model` section of this network, when the source tells
    all of it (Hugging Face models); None for Megatron checkpoints."""
    side_files: list
    """Files copied next to the output unchanged (a Hugging Face model's tokenizer)."""

    def layer(self, index: int) -> DenseLayer: ...

    def non_layer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def non_layer_objects(self) -> list[ObjectItem]: ...


def check_not_moe(keys, where: str) -> None:
    """Refuse a checkpoint that already has MoE layers."""
    for key in keys:
        if any(marker in f".{key}" for marker in MOE_MARKERS):
            raise CheckpointError(f"{where} is already an MoE checkpoint ({key}); the upcycler "
                                  "needs a dense checkpoint")


def resolve_checkpoint_dir(path: Path) -> Path:
    """The checkpoint directory `path` designates (see the module docstring)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is not a directory")
    tracker = path / TRACKER
    if tracker.exists():
        text = tracker.read_text().strip()
        name = "release" if text == "release" else _iteration_dir(text, tracker)
        if not (path / name).is_dir():
            raise CheckpointError(f"{tracker} names {name}, which does not exist in {path}")
        return path / name
    if (path / "metadata.json").exists() or _has_rank_dirs(path):
        return path
    iterations = sorted((int(m.group(1)), child) for child in path.iterdir()
                        if (m := re.fullmatch(r"iter_(\d+)", child.name)) and child.is_dir())
    if iterations:
        return iterations[-1][1]
    raise CheckpointError(f"no dense checkpoint at {path}: expected {TRACKER}, iter_* "
                          "directories, metadata.json (torch_dist) or mp_rank_*/"
                          "model_optim_rng.pt (legacy)")


def open_dense_checkpoint(path) -> DenseSource:
    """Detect the format of the checkpoint at `path` and open it for layer-by-layer reading."""
    from megamoe.interop.hf_source import HFSource, is_hf_directory
    from megamoe.upcycle.dist_source import DistSource
    from megamoe.upcycle.legacy_source import LegacySource

    if is_hf_directory(Path(path)):
        return HFSource(Path(path))
    directory = resolve_checkpoint_dir(Path(path))
    if (directory / "metadata.json").exists():
        metadata = read_json(inside(directory, "metadata.json"), 1 << 16, CheckpointError)
        backend = metadata.get("sharded_backend") if isinstance(metadata, dict) else None
        if not isinstance(backend, str):
            raise CheckpointError(f"{directory}/metadata.json is not Megatron checkpoint "
                                  "metadata; the checkpoint is corrupt")
        if backend != "torch_dist":
            raise CheckpointError(f"{directory} is a {backend!r} distributed checkpoint; only "
                                  "torch_dist is supported (convert it with Megatron first)")
        return DistSource(directory)
    if _has_rank_dirs(directory):
        return LegacySource(directory)
    raise CheckpointError(f"unknown checkpoint format in {directory}: neither metadata.json "
                          "(torch_dist) nor mp_rank_*/model_optim_rng.pt (legacy)")


def _iteration_dir(text: str, tracker: Path) -> str:
    try:
        return f"iter_{int(text):07d}"
    except ValueError:
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number or "
                              "'release'") from None


def _has_rank_dirs(path: Path) -> bool:
    return any(child.name.startswith("mp_rank_") for child in path.iterdir())
