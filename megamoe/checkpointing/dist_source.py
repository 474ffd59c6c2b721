"""Dense torch_dist checkpoints (Megatron-Core `dist_checkpointing`, any TP/PP layout).

A torch_dist checkpoint stores global tensors, so tensor- and pipeline-parallel layouts need no
merging: a layer is read as its slice of each stacked `decoder.layers.*` tensor (or its own
`decoder.layers.<i>.*` keys), and GLU halves saved under separate `_w`/`_v` keys are joined.
Optimizer state, RNG state and the rerun state machine are skipped. A checkpoint with a megamoe
manifest (megamoe.checkpointing.manifest) is verified before anything is read.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterator, Optional

import torch

from megamoe.checkpointing.dcp_reader import DCPReader
from megamoe.checkpointing.manifest import has_manifest, verify_folder
from megamoe.checkpointing.safe_dcp import common_state_problem, load_common_state
from megamoe.checkpointing.sharded_keys import LAYER_PREFIX, ObjectItem
from megamoe.checkpointing.source import DenseLayer, check_not_moe
from megamoe.errors import CheckpointError

# Not model weights; `common_state` is megatron-core 0.19's common state (read by _saved_args).
SKIPPED_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state", "common_state")
STACKED = -1


def split_layer_key(key: str) -> tuple[Optional[int], str]:
    """(layer, suffix) of a key: layer None outside `decoder.layers.`, STACKED for a stacked
    key, else the layer index of a `decoder.layers.<i>.` key."""
    if not key.startswith(LAYER_PREFIX):
        return None, key
    rest = key[len(LAYER_PREFIX):]
    head, _, tail = rest.partition(".")
    return (int(head), tail) if head.isdigit() else (STACKED, rest)


def join_glu_halves(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Join Megatron's singleton-layout GLU halves `<key>_w` (gate) and `<key>_v` (up)."""
    joined = dict(tensors)
    for suffix in tensors:
        base = suffix[:-2]
        if suffix.endswith("_w") and f"{base}_v" in tensors:
            joined[base] = torch.cat([joined.pop(suffix), joined.pop(f"{base}_v")])
    return joined


class DistSource:
    """A dense torch_dist checkpoint read layer by layer (see megamoe.checkpointing.source)."""

    format = "torch_dist"
    model_settings = None

    def __init__(self, directory: Path, moe: bool = False):
        """moe: also accept (and read) MoE layers, for exporters; the upcycler refuses them."""
        if has_manifest(directory):
            problem = verify_folder(directory)
            if problem is not None:
                raise CheckpointError(f"checkpoint {directory} is unusable: {problem}; restore "
                                      "it or use another checkpoint")
        self.reader = DCPReader(directory)
        self.args = _saved_args(directory)
        tensors = {key: md for key, md in self.reader.tensors().items()
                   if not key.startswith(SKIPPED_PREFIXES)}
        objects = [key for key in self.reader.objects() if not key.startswith(SKIPPED_PREFIXES)]
        if not moe:
            check_not_moe(list(tensors) + objects, str(directory))
        self._stacked: dict[str, tuple[int, ...]] = {}
        self._layer_keys: dict[int, list[str]] = {}
        self._non_layer: list[str] = []
        for key, md in tensors.items():
            layer, suffix = split_layer_key(key)
            if layer is None:
                self._non_layer.append(key)
            elif layer == STACKED:
                self._stacked[suffix] = tuple(md.size)
            else:
                self._layer_keys.setdefault(layer, []).append(key)
        self._layer_objects: dict[int, dict[str, str]] = {}
        self._non_layer_objects: list[str] = []
        for key in objects:
            self._index_object(key)
        self.num_layers = self._count_layers(directory)
        if not any(s.endswith("linear_fc2.weight") for s in self._suffixes()):
            raise CheckpointError(f"{directory} has no decoder.layers.*mlp.linear_fc2.weight; "
                                  "it is not a dense Megatron-Core GPT checkpoint")
        self.key_layout = ("stacked" if self._stacked else
                           "singleton" if any(s.endswith("_w") for s in self._suffixes())
                           else "per_layer")
        self.description = f"torch_dist ({self.key_layout}) at {directory}"

    def layer(self, index: int) -> DenseLayer:
        tensors = {}
        for suffix, shape in self._stacked.items():
            tensors[suffix] = self.reader.read(LAYER_PREFIX + suffix, (index,) + (0,) * (
                len(shape) - 1), (1,) + shape[1:])[0]
        prefix = f"{LAYER_PREFIX}{index}."
        for key in self._layer_keys.get(index, []):
            tensors[key[len(prefix):]] = self.reader.read(key)
        objects = {suffix: self.reader.read_object(key)
                   for suffix, key in self._layer_objects.get(index, {}).items()}
        return DenseLayer(join_glu_halves(tensors), objects)

    def non_layer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self._non_layer:
            yield key, self.reader.read(key)

    def non_layer_objects(self) -> list[ObjectItem]:
        return [ObjectItem(key, self.reader.read_object(key)) for key in self._non_layer_objects]

    def _index_object(self, key: str) -> None:
        base, _, shard = key.partition("/shard_")
        layer, suffix = split_layer_key(base)
        if layer is None:
            self._non_layer_objects.append(key)
            return
        if layer == STACKED:
            layer = int(shard.rsplit("_", 1)[0].split(".")[0])
        self._layer_objects.setdefault(layer, {})[suffix] = key

    def _suffixes(self) -> set[str]:
        per_layer = {split_layer_key(key)[1] for keys in self._layer_keys.values() for key in keys}
        return set(self._stacked) | per_layer

    def _count_layers(self, directory: Path) -> int:
        counts = {shape[0] for shape in self._stacked.values()}
        if len(counts) > 1:
            raise CheckpointError(f"{directory}: stacked layer tensors disagree on the number of "
                                  f"layers {sorted(counts)}; the checkpoint is corrupt")
        stacked = counts.pop() if counts else 0
        indexed = max(self._layer_keys, default=-1) + 1
        if stacked and indexed and stacked != indexed:
            raise CheckpointError(f"{directory}: {stacked} stacked layers but per-layer keys up "
                                  f"to layer {indexed - 1}; the checkpoint is corrupt")
        missing = sorted(set(range(indexed)) - set(self._layer_keys)) if indexed else []
        if missing:
            raise CheckpointError(f"{directory}: no tensors for layers {missing}; the checkpoint "
                                  "is incomplete")
        return stacked or indexed


def _saved_args(directory: Path) -> Optional[argparse.Namespace]:
    """Megatron-LM's `args` from the checkpoint's common state, if present."""
    if common_state_problem(directory) is not None:
        return None
    common = load_common_state(directory)
    args = common.get("args") if isinstance(common, dict) else None
    return args if isinstance(args, argparse.Namespace) else None
