"""The checkpoint items (tensor chunks and sharded objects) of one converted layer.

A dense layer is passed through. An MoE layer keeps everything but the dense MLP and gains, in
Megatron-Core's MoE layout (local spec, SequentialMLP): `mlp.router.weight` [E, H],
`mlp.router.expert_bias` [E] (fp32 zeros), per expert `mlp.experts.experts.linear_fc{1,2}.weight`
(global expert ids), optionally `mlp.shared_experts.linear_fc{1,2}.weight`, and for each new
linear layer a copy of the dense linear's `_extra_state` object, when the source has one.
Expert tensors are produced lazily, one expert at a time, while the writer writes them.
"""
from __future__ import annotations

import torch

from megamoe.checkpointing.sharded_keys import KeyLayout, ObjectItem, TensorChunk
from megamoe.checkpointing.source import DenseLayer
from megamoe.errors import CheckpointError, ConfigError
from megamoe.upcycle.experts import LayerUpcycler
from megamoe.upcycle.granular import MLPWeights, dense_mlp
from megamoe.upcycle.recipe import UpcycleRecipe

FC1, FC2 = "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"
FC_EXTRA = {1: "mlp.linear_fc1._extra_state", 2: "mlp.linear_fc2._extra_state"}
MLP_BIASES = ("mlp.linear_fc1.bias", "mlp.linear_fc2.bias")
# The pre-MLP norm: fused into fc1's key in the local spec (and in dense TE layers); a separate
# TENorm module in Transformer Engine MoE layers.
TE_NORM_KEYS = {"mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def layer_dense_mlp(dense: DenseLayer, layer: int) -> MLPWeights:
    """The layer's dense MLP, checked to be one the upcycler supports."""
    if FC1 not in dense.tensors or FC2 not in dense.tensors:
        raise CheckpointError(f"layer {layer} has no {FC1} / {FC2}; only Megatron-Core dense "
                              "MLPs (local or Transformer Engine spec) can be upcycled")
    biases = [key for key in MLP_BIASES if key in dense.tensors]
    if biases:
        raise CheckpointError(f"layer {layer} has MLP biases {biases}; upcycling MLPs with "
                              "biases (add_bias_linear=True) is not supported")
    return dense_mlp(dense.tensors[FC1], dense.tensors[FC2])


def _passthrough(layout: KeyLayout, suffix: str, layer: int, tensor: torch.Tensor,
                 glu_halves: bool) -> list[TensorChunk]:
    return layout.layer_tensor(suffix, layer, tuple(tensor.shape), tensor.dtype,
                               lambda: tensor, glu_halves)


def dense_layer_items(layout: KeyLayout, layer: int,
                      dense: DenseLayer) -> tuple[list[TensorChunk], list[ObjectItem]]:
    """A dense layer, unchanged, in the output layout."""
    fc1, fc2 = dense.tensors.get(FC1), dense.tensors.get(FC2)
    gated = fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[1]
    chunks = [chunk for suffix, tensor in dense.tensors.items()
              for chunk in _passthrough(layout, suffix, layer, tensor,
                                        glu_halves=gated and suffix == FC1)]
    objects = [layout.layer_object(suffix, layer, data) for suffix, data in dense.objects.items()]
    return chunks, objects


def moe_layer_items(layout: KeyLayout, layer: int, dense: DenseLayer, recipe: UpcycleRecipe,
                    activation: str) -> tuple[list[TensorChunk], list[ObjectItem]]:
    """An MoE layer made from `dense` by `recipe`, in the output layout."""
    mlp = layer_dense_mlp(dense, layer)
    if mlp.ffn_size % recipe.granularity:
        raise ConfigError(f"granularity={recipe.granularity} does not divide the dense FFN size "
                          f"{mlp.ffn_size} of layer {layer}; pick a divisor")
    upcycler = LayerUpcycler(recipe, mlp, layer, activation)
    chunks, objects = [], []
    for suffix, tensor in dense.tensors.items():
        if suffix not in (FC1, FC2):
            out = TE_NORM_KEYS.get(suffix, suffix) if recipe.target_spec == "te" else suffix
            chunks += _passthrough(layout, out, layer, tensor, glu_halves=False)
    objects += [layout.layer_object(suffix, layer, data) for suffix, data in dense.objects.items()
                if suffix not in FC_EXTRA.values()]

    E, H, dtype = recipe.num_experts, mlp.fc1.shape[1], mlp.fc1.dtype
    chunks += layout.layer_tensor("mlp.router.weight", layer, (E, H), dtype,
                                  upcycler.router_weight)
    chunks += layout.layer_tensor("mlp.router.expert_bias", layer, (E,), torch.float32,
                                  upcycler.expert_bias)
    size = mlp.ffn_size // recipe.granularity
    fc1_shape = (size * (2 if mlp.gated else 1), H)
    for expert in range(E):
        chunks += layout.expert_tensor("linear_fc1.weight", layer, expert, E, fc1_shape, dtype,
                                       lambda e=expert: upcycler.expert(e).fc1, mlp.gated)
        chunks += layout.expert_tensor("linear_fc2.weight", layer, expert, E, (H, size), dtype,
                                       lambda e=expert: upcycler.expert(e).fc2)
        objects += [layout.expert_object(f"linear_fc{i}._extra_state", layer, expert, E,
                                         dense.objects[key])
                    for i, key in FC_EXTRA.items() if key in dense.objects]
    if recipe.shared_expert:
        shared = upcycler.shared_expert()
        chunks += _passthrough(layout, "mlp.shared_experts.linear_fc1.weight", layer, shared.fc1,
                               glu_halves=mlp.gated)
        chunks += _passthrough(layout, "mlp.shared_experts.linear_fc2.weight", layer, shared.fc2,
                               glu_halves=False)
        if recipe.shared_expert_gate:
            chunks += _passthrough(layout, "mlp.shared_experts.gate_weight", layer,
                                   upcycler.shared_expert_gate(), glu_halves=False)
        objects += [layout.layer_object(f"mlp.shared_experts.linear_fc{i}._extra_state", layer,
                                        dense.objects[key])
                    for i, key in FC_EXTRA.items() if key in dense.objects]
    return chunks, objects
