"""Dense legacy checkpoints: one `torch.save` file per model-parallel rank,
`mp_rank_<tp:02d>[_<pp:03d>]/model_optim_rng.pt`, holding `model` (or `model0`, `model1`, ...
for virtual pipeline stages) = the rank's module `state_dict()`.

Files are memory-mapped, so opening them costs little and a layer's pages are read when that
layer is converted. Layer indices in a file are local to its pipeline stage (and virtual chunk);
global indices follow Megatron's order: chunk 0 of stages 0..P-1, then chunk 1, and so on.
Tensor-parallel shards are merged: column-parallel weights along dim 0 (a GLU fc1's gate and up
halves each gathered separately, since every rank holds [gate_r; up_r]), row-parallel weights
along dim 1; every other tensor must be identical on all ranks.
"""
from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Iterator

import torch

from megamoe.checkpointing.sharded_keys import LAYER_PREFIX, ObjectItem, object_key
from megamoe.checkpointing.source import DenseLayer, check_not_moe
from megamoe.checkpointing.torch_files import load_torch_file
from megamoe.errors import CheckpointError

FILE_NAME = "model_optim_rng.pt"
EXTRA_STATE = "_extra_state"
COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                   "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "word_embeddings.weight",
                   "output_layer.weight", "output_layer.bias")
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
GLU_FC1 = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
# Module names of the local spec's separate norms -> the sharded keys Megatron saves them under.
MODULE_TO_SHARDED = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                     ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def sharded_suffix(module_suffix: str) -> str:
    """Megatron's sharded-key suffix for a layer's module state_dict key suffix."""
    for module, sharded in MODULE_TO_SHARDED:
        if module_suffix.startswith(module):
            return sharded + module_suffix[len(module):]
    return module_suffix


def merge_tensor_parallel(key: str, shards: list[torch.Tensor], glu: bool) -> torch.Tensor:
    """The global tensor from its tensor-parallel shards (rank order)."""
    if len(shards) == 1:
        return shards[0]
    if glu and key.endswith(GLU_FC1):
        halves = [shard.chunk(2) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves])
    if key.endswith(COLUMN_PARALLEL):
        return torch.cat(shards, dim=0)
    if key.endswith(ROW_PARALLEL):
        return torch.cat(shards, dim=1)
    if all(shard.shape == shards[0].shape and torch.equal(shard, shards[0])
           for shard in shards[1:]):
        return shards[0]
    raise CheckpointError(f"{key} differs across tensor-parallel ranks but is not a known "
                          "tensor-parallel weight; merge it to TP=1 with Megatron first")


def serialize_extra_state(value) -> bytes:
    """Bytes of a `_extra_state` value as Megatron's torch_dist stores sharded objects."""
    buffer = io.BytesIO()
    torch.save([value], buffer)
    return buffer.getvalue()


class LegacySource:
    """A dense legacy checkpoint read layer by layer (see megamoe.checkpointing.source)."""

    format = "legacy"
    model_settings = None
    key_layout = "module"

    def __init__(self, directory: Path):
        ranks = self._rank_files(directory)
        tp_size = max(tp for tp, _ in ranks) + 1
        pp_size = max(pp for _, pp in ranks) + 1
        missing = [f"tp={tp} pp={pp}" for tp in range(tp_size) for pp in range(pp_size)
                   if (tp, pp) not in ranks]
        if missing:
            raise CheckpointError(f"{directory} lacks the files of ranks {missing}; the legacy "
                                  "checkpoint is incomplete")
        states = {rank: load_torch_file(path, mmap=True) for rank, path in ranks.items()}
        first = states[(0, 0)]
        chunk_names = sorted((k for k in first if re.fullmatch(r"model\d*", k)),
                             key=lambda k: int(k[5:] or 0))
        if not chunk_names:
            raise CheckpointError(f"{ranks[(0, 0)]} has no 'model' entry; it is not a Megatron "
                                  "checkpoint")
        # stages in global layer order: virtual chunk, then pipeline rank
        self._stages = [[states[(tp, pp)][name] for tp in range(tp_size)]
                        for name in chunk_names for pp in range(pp_size)]
        for stage in self._stages:
            check_not_moe(stage[0], str(directory))
        self._layer_index: list[tuple[int, int]] = []
        for stage_index, stage in enumerate(self._stages):
            count = max((int(key[len(LAYER_PREFIX):].split(".")[0]) for key in stage[0]
                         if key.startswith(LAYER_PREFIX)), default=-1) + 1
            self._layer_index += [(stage_index, local) for local in range(count)]
        self.num_layers = len(self._layer_index)
        if self.num_layers == 0:
            raise CheckpointError(f"{directory} holds no decoder layers")
        args = first.get("args")
        self.args = args if args is not None and hasattr(args, "__dict__") else None
        self.description = (f"legacy (TP={tp_size}, PP={pp_size}, {len(chunk_names)} virtual "
                            f"chunk(s)) at {directory}")

    def layer(self, index: int) -> DenseLayer:
        stage_index, local = self._layer_index[index]
        stage = self._stages[stage_index]
        prefix = f"{LAYER_PREFIX}{local}."
        keys = [key for key in stage[0] if key.startswith(prefix)]
        fc1, fc2 = (stage[0].get(f"{prefix}mlp.linear_fc{i}.weight") for i in (1, 2))
        glu = fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[1]
        layer = DenseLayer()
        for key in keys:
            suffix = sharded_suffix(key[len(prefix):])
            if key.endswith(EXTRA_STATE):
                layer.objects[suffix] = serialize_extra_state(stage[0][key])
            else:
                layer.tensors[suffix] = merge_tensor_parallel(
                    suffix, [shards[key] for shards in stage], glu)
        return layer

    def non_layer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for stage in self._stages:
            for key in stage[0]:
                if not key.startswith(LAYER_PREFIX) and not key.endswith(EXTRA_STATE):
                    yield key, merge_tensor_parallel(key, [shards[key] for shards in stage],
                                                     glu=False)

    def non_layer_objects(self) -> list[ObjectItem]:
        return [ObjectItem(object_key(key), serialize_extra_state(stage[0][key]))
                for stage in self._stages for key in stage[0]
                if not key.startswith(LAYER_PREFIX) and key.endswith(EXTRA_STATE)]

    @staticmethod
    def _rank_files(directory: Path) -> dict[tuple[int, int], Path]:
        ranks = {}
        for child in sorted(directory.iterdir()):
            match = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?(_\d+)?", child.name)
            if not match:
                continue
            if match.group(3):
                raise CheckpointError(f"{child} is an expert-parallel rank: the checkpoint is "
                                      "already MoE; the upcycler needs a dense checkpoint")
            if not (child / FILE_NAME).exists():
                raise CheckpointError(f"{child} has no {FILE_NAME}; the checkpoint is incomplete")
            ranks[(int(match.group(1)), int(match.group(2) or 0))] = child / FILE_NAME
        if not ranks:
            raise CheckpointError(f"{directory} has no mp_rank_*/{FILE_NAME} files")
        return ranks
