"""Megatron-Core's distributed-checkpoint key layout for GPT layers, dense and MoE.

Where each per-layer tensor lives in a torch_dist checkpoint (checked against megatron-core
0.16.1's TransformerBlock, MLP and SequentialMLP `sharded_state_dict`):

- stacked (Megatron's default when all layers are alike): key `decoder.layers.<suffix>`, global
  shape [L, ...], layer l at offset l of axis 0. Experts add an axis:
  `decoder.layers.mlp.experts.experts.<name>` [L, E, ...] (global expert ids).
- per_layer (`moe_layer_freq` > 1 or a list): key `decoder.layers.<l>.<suffix>`, no layer axis;
  experts `decoder.layers.<l>.mlp.experts.experts.<name>` [E, ...].
- singleton (`singleton_local_shards` metadata): per-layer keys, one key per expert
  (`...experts.experts.<e>.<name>`), and a GLU fc1 stored as two keys `<key>_w` and `<key>_v`.

A GLU fc1 [2F, H] is stored as two chunks, gate half at row 0 and up half at row F of the
global tensor, as Megatron's swiglu sharded factory writes it. Sharded objects (`_extra_state`)
are keyed `<key>/shard_<offsets>_<shape>`, offsets and shape over the layer and expert axes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LAYER_PREFIX = "decoder.layers."
EXPERTS = "mlp.experts.experts."
LAYOUTS = ("stacked", "per_layer", "singleton")


@dataclass(frozen=True)
class TensorChunk:
    """One chunk of a global tensor; `make()` returns its data (shape `shape`) when written."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class ObjectItem:
    """A sharded object: its unique key and its serialized bytes."""

    key: str
    data: bytes


def object_key(key: str, offsets: tuple[int, ...] = (0,), shape: tuple[int, ...] = (1,)) -> str:
    """Megatron's ShardedObject unique key."""
    return f"{key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def whole_tensor(key: str, tensor: torch.Tensor) -> TensorChunk:
    """A tensor outside the layers (embedding, final norm, output layer) as one chunk."""
    shape = tuple(tensor.shape)
    return TensorChunk(key, shape, (0,) * len(shape), shape, tensor.dtype, lambda: tensor)


def _unsqueezed(make: Callable[[], torch.Tensor], rows: slice | None, dims: int):
    def chunk() -> torch.Tensor:
        tensor = make()
        if rows is not None:
            tensor = tensor[rows]
        return tensor.reshape((1,) * dims + tuple(tensor.shape))

    return chunk


class KeyLayout:
    """Keys, global shapes and chunk offsets of one checkpoint with `num_layers` layers."""

    def __init__(self, kind: str, num_layers: int):
        if kind not in LAYOUTS:
            raise ValueError(f"unknown key layout {kind!r}")
        self.kind = kind
        self.num_layers = num_layers

    def layer_tensor(self, suffix: str, layer: int, tensor_shape: tuple[int, ...],
                     dtype: torch.dtype, make: Callable[[], torch.Tensor],
                     glu_halves: bool = False) -> list[TensorChunk]:
        """Chunks of a per-layer tensor (e.g. suffix `self_attention.linear_qkv.weight`)."""
        if self.kind == "stacked":
            return self._chunks(LAYER_PREFIX + suffix, (layer,), (self.num_layers,),
                                tensor_shape, dtype, make, glu_halves, singleton=False)
        return self._chunks(f"{LAYER_PREFIX}{layer}.{suffix}", (), (), tensor_shape, dtype, make,
                            glu_halves, singleton=self.kind == "singleton")

    def expert_tensor(self, name: str, layer: int, expert: int, num_experts: int,
                      tensor_shape: tuple[int, ...], dtype: torch.dtype,
                      make: Callable[[], torch.Tensor],
                      glu_halves: bool = False) -> list[TensorChunk]:
        """Chunks of routed expert `expert`'s tensor `name` (e.g. `linear_fc2.weight`)."""
        if self.kind == "stacked":
            return self._chunks(LAYER_PREFIX + EXPERTS + name, (layer, expert),
                                (self.num_layers, num_experts), tensor_shape, dtype, make,
                                glu_halves, singleton=False)
        if self.kind == "per_layer":
            return self._chunks(f"{LAYER_PREFIX}{layer}.{EXPERTS}{name}", (expert,),
                                (num_experts,), tensor_shape, dtype, make, glu_halves,
                                singleton=False)
        return self._chunks(f"{LAYER_PREFIX}{layer}.{EXPERTS}{expert}.{name}", (), (),
                            tensor_shape, dtype, make, glu_halves, singleton=True)

    def layer_object(self, suffix: str, layer: int, data: bytes) -> ObjectItem:
        """A per-layer sharded object (e.g. suffix `self_attention.linear_qkv._extra_state`)."""
        if self.kind == "stacked":
            return ObjectItem(object_key(LAYER_PREFIX + suffix, (layer,), (self.num_layers,)),
                              data)
        return ObjectItem(object_key(f"{LAYER_PREFIX}{layer}.{suffix}"), data)

    def expert_object(self, name: str, layer: int, expert: int, num_experts: int,
                      data: bytes) -> ObjectItem:
        """Routed expert `expert`'s sharded object `name` (e.g. `linear_fc1._extra_state`)."""
        if self.kind == "stacked":
            return ObjectItem(object_key(LAYER_PREFIX + EXPERTS + name, (layer, expert),
                                         (self.num_layers, num_experts)), data)
        if self.kind == "per_layer":
            return ObjectItem(object_key(f"{LAYER_PREFIX}{layer}.{EXPERTS}{name}", (expert,),
                                         (num_experts,)), data)
        return ObjectItem(object_key(f"{LAYER_PREFIX}{layer}.{EXPERTS}{expert}.{name}"), data)

    @staticmethod
    def _chunks(key: str, offsets: tuple[int, ...], counts: tuple[int, ...],
                tensor_shape: tuple[int, ...], dtype: torch.dtype,
                make: Callable[[], torch.Tensor], glu_halves: bool,
                singleton: bool) -> list[TensorChunk]:
        dims = len(offsets)
        unit = (1,) * dims
        if not glu_halves:
            return [TensorChunk(key, counts + tensor_shape, offsets + (0,) * len(tensor_shape),
                                unit + tensor_shape, dtype, _unsqueezed(make, None, dims))]
        half = tensor_shape[0] // 2
        half_shape = (half,) + tensor_shape[1:]
        tail = (0,) * (len(tensor_shape) - 1)
        gate, up = slice(0, half), slice(half, 2 * half)
        if singleton:
            return [TensorChunk(f"{key}{suffix}", counts + half_shape, offsets + (0,) + tail,
                                unit + half_shape, dtype, _unsqueezed(make, rows, dims))
                    for suffix, rows in (("_w", gate), ("_v", up))]
        return [TensorChunk(key, counts + tensor_shape, offsets + (start,) + tail,
                            unit + half_shape, dtype, _unsqueezed(make, rows, dims))
                for start, rows in ((0, gate), (half, up))]
