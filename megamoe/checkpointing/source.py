"""A dense Megatron-Core GPT checkpoint, whatever its format: the common interface the converter
reads through (the readers: `megamoe.checkpointing.readers`).

The readers return global (tensor-parallel merged) tensors keyed by Megatron's sharded-key
suffix within a layer (e.g. `self_attention.linear_qkv.weight`, `mlp.linear_fc1.weight`,
`mlp.linear_fc1.layer_norm_weight`), one layer at a time.

Accepted paths: a Hugging Face model directory (`config.json` + safetensors, read by
megamoe.checkpointing.hf_source), a Megatron-LM checkpoint root
(`latest_checkpointed_iteration.txt` names the iteration), a root holding `iter_*` directories
(the latest is taken), or one checkpoint directory: torch_dist (`metadata.json` + `.metadata`
+ `*.distcp`) or legacy per-rank files (`mp_rank_XX[_YYY]/model_optim_rng.pt`).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Protocol

import torch

from megamoe.checkpointing.layout import TRACKER, read_tracker
from megamoe.checkpointing.sharded_keys import ObjectItem
from megamoe.errors import CheckpointError

MOE_MARKERS = (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")


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
    tracked = read_tracker(path, allow_release=True)
    if tracked is not None:
        tracker, name = tracked
        if not (path / name).is_dir():
            raise CheckpointError(f"{tracker} names {name}, which does not exist in {path}")
        return path / name
    if (path / "metadata.json").exists() or has_rank_dirs(path):
        return path
    iterations = sorted((int(m.group(1)), child) for child in path.iterdir()
                        if (m := re.fullmatch(r"iter_(\d+)", child.name)) and child.is_dir())
    if iterations:
        return iterations[-1][1]
    raise CheckpointError(f"no dense checkpoint at {path}: expected {TRACKER}, iter_* "
                          "directories, metadata.json (torch_dist) or mp_rank_*/"
                          "model_optim_rng.pt (legacy)")


def has_rank_dirs(path: Path) -> bool:
    return any(child.name.startswith("mp_rank_") for child in path.iterdir())
