"""The distributed-checkpoint (torch_dist) layout of a megamoe layer: exactly Megatron-Core's own
MoE layout (TopKRouter, SequentialMLP experts, SharedExpertMLP), so a checkpoint moves between
megamoe and Megatron-Core MoE models and between expert-parallel sizes.

Sharded keys under the layer prefix P (Megatron then folds the layer index into a leading axis):
- `P router.weight` [E, D], `P router.expert_bias` [E]: replicated over TP x DP x CP.
- `P experts.experts.linear_fc1.weight` [E, F', D] and `P experts.experts.linear_fc2.weight`
  [E, D, F]: one shard per expert on the GLOBAL expert axis (ep_rank * L + local index), so any
  expert-parallel size can load them; replicated over the expert-data-parallel group. With
  expert biases, `P experts.experts.linear_fc1.bias` [E, F'] and `linear_fc2.bias` [E, D] the
  same way (GLU fc1 bias in halves too, as Megatron's MLP saves it).
- `P shared_experts.linear_fc1.weight`, `linear_fc2.weight`, `gate_weight`: replicated.
- Latent MoE: `P fc1_latent_proj.weight` [latent, D] and `P fc2_latent_proj.weight` [D, latent]
  (and biases), replicated, as Megatron's duplicated TELinear saves them.
- `... linear_fc{1,2}._extra_state`: the empty objects Megatron's linear layers save, so Megatron
  finds every key it asks for; megamoe drops them on load (`drop_extra_state_placeholders`).
GLU fc1 weights (F' = 2F) are saved as their gate and up halves, two shards of the output axis, as
Megatron's `apply_swiglu_sharded_factory` does. With `metadata['singleton_local_shards']` every
expert is a key of its own, `P experts.experts.{g}.linear_fc1.weight` (GLU halves `_w`, `_v`).
Expert weights go through a ShardedTensorFactory over the stacked [L, out, in] tensor, so the
optimizer's states of those weights are saved in the same per-expert layout.

Shape legend: L local experts, E experts, D hidden, F expert FFN size, F' = 2F for GLU.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, \
    make_sharded_object_for_checkpoint, make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, make_sharded_tensor_for_checkpoint

from megamoe.errors import CheckpointError

EXTRA_STATE = "_extra_state"


def moe_sharded_state_dict(layer: Any, prefix: str, sharded_offsets: tuple,
                           metadata: Optional[dict]) -> dict:
    """The sharded state dict of a MegatronMoELayer (see the module docstring for the layout)."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    groups = dict(tp_group=layer.pg_collection.tp, dp_cp_group=metadata["dp_cp_group"])
    singleton = bool(metadata.get("singleton_local_shards", False))
    sharded = make_sharded_tensors_for_checkpoint(
        layer.router.state_dict(keep_vars=True), f"{prefix}router.",
        sharded_offsets=sharded_offsets, **groups)
    sharded.update(_experts(layer, f"{prefix}experts.", sharded_offsets, singleton))
    if layer.shared_experts is not None:
        sharded.update(_shared_expert(layer, f"{prefix}shared_experts.", sharded_offsets,
                                      singleton, groups))
    if layer.fc1_latent_proj is not None:
        for name in ("fc1_latent_proj", "fc2_latent_proj"):
            sharded.update(_replicated_linear(getattr(layer, name), f"{prefix}{name}.",
                                              sharded_offsets, groups))
    return sharded


def drop_extra_state_placeholders(module, state_dict, prefix, *args) -> None:
    """Load pre-hook: remove the `_extra_state` placeholders that `moe_sharded_state_dict` adds
    for Megatron (megamoe's modules have no extra state)."""
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith(EXTRA_STATE)]:
        del state_dict[key]


def _experts(layer: Any, prefix: str, sharded_offsets: tuple, singleton: bool) -> dict:
    """The stacked expert weights (and biases) as factories, plus Megatron's per-expert
    `_extra_state`."""
    L = layer.experts.num_local_experts
    first, num_global = layer.ep_comm.rank * L, layer.ep_comm.size * L
    replica_id = (0, 0, get_pg_rank(layer.pg_collection.expt_dp))
    sharded = {}
    glu = layer.cfg.experts.gated
    stacked = [("linear_fc1.weight", "fc1_weight", glu), ("linear_fc2.weight", "fc2_weight", False)]
    if layer.experts.fc1_bias is not None:
        stacked += [("linear_fc1.bias", "fc1_bias", glu), ("linear_fc2.bias", "fc2_bias", False)]
    for name, attr, halves in stacked:
        build = _expert_shards_builder(first, L, num_global, sharded_offsets, halves, singleton)
        param = getattr(layer.experts, attr)
        sharded[f"{prefix}{attr}"] = ShardedTensorFactory(
            f"{prefix}experts.{name}", param, build, _experts_merger(param.shape), replica_id)
    for name in ("linear_fc1", "linear_fc2"):
        for g in range(first, first + L):
            key, offsets = _expert_key_and_offsets(f"{prefix}experts.{name}.{EXTRA_STATE}", g,
                                                   num_global, sharded_offsets, singleton)
            sharded[f"{prefix}expert{g}.{name}.{EXTRA_STATE}"] = \
                make_sharded_object_for_checkpoint(None, key, offsets, replica_id)
    return sharded


def _expert_key_and_offsets(key: str, g: int, num_global: int, sharded_offsets: tuple,
                            singleton: bool) -> tuple[str, tuple]:
    """Megatron's SequentialMLP naming: expert g as row g of a global expert axis, or (singleton
    local shards) as key `...experts.{g}.<name>` without that axis."""
    if singleton:
        head, tail = key.rsplit("experts.", 1)
        return f"{head}experts.{g}.{tail}", tuple(sharded_offsets)
    return key, (*sharded_offsets, (len(sharded_offsets), g, num_global))


def _expert_shards_builder(first: int, num_local: int, num_global: int, sharded_offsets: tuple,
                           glu: bool, singleton: bool):
    """build_fn of the factory of a stacked weight t_LOI (or a flat bias, one expert after
    another): per local expert, its ShardedTensor at global expert first + l, or its [gate, up]
    halves for GLU."""

    @torch.no_grad()
    def build(key: str, t_LOI: torch.Tensor, replica_id: Any, flattened_range: Optional[slice]):
        if flattened_range is not None:
            raise CheckpointError(
                "megamoe expert weights cannot be saved in a flattened (fully sharded "
                "distributed-optimizer) layout; use the distributed optimizer's default "
                "'dp_zero_gather_scatter' sharding"
            )
        shards = []
        for local, t_OI in enumerate(t_LOI.view(num_local, -1, *t_LOI.shape[2:])):
            expert_key, offsets = _expert_key_and_offsets(key, first + local, num_global,
                                                          sharded_offsets, singleton)
            if glu and singleton:
                halves = [(f"{expert_key}_w", ()), (f"{expert_key}_v", ())]
            elif glu:
                halves = [(expert_key, ((len(offsets), 0, 2),)),
                          (expert_key, ((len(offsets), 1, 2),))]
            else:
                halves = [(expert_key, ())]
            shards.append([
                ShardedTensor.from_rank_offsets(half_key, part.contiguous(), *offsets, *half,
                                                replica_id=replica_id,
                                                prepend_axis_num=len(offsets))
                for (half_key, half), part in zip(halves, t_OI.chunk(len(halves)))
            ])
        return shards

    return build


def _experts_merger(shape: torch.Size):
    """merge_fn: the loaded per-expert shards (GLU halves) back into the parameter's `shape`
    (stacked [L, out, in], or a flat bias)."""

    @torch.no_grad()
    def merge(loaded: list[list[torch.Tensor]]) -> torch.Tensor:
        return torch.stack([torch.cat(parts) for parts in loaded]).reshape(shape)

    return merge


def _replicated_linear(linear: torch.nn.Module, prefix: str, sharded_offsets: tuple,
                       groups: dict) -> dict:
    """A linear layer every rank holds whole, with Megatron's `_extra_state` placeholder."""
    sharded = {f"{prefix}{name}": make_sharded_tensor_for_checkpoint(
        value, f"{prefix}{name}", prepend_offsets=sharded_offsets, **groups)
        for name, value in linear.state_dict(keep_vars=True).items()}
    replica_id = (0, get_pg_rank(groups["tp_group"]), get_pg_rank(groups["dp_cp_group"]))
    key = f"{prefix}{EXTRA_STATE}"
    sharded[key] = make_sharded_object_for_checkpoint(None, key, sharded_offsets, replica_id)
    return sharded


def _shared_expert(layer: Any, prefix: str, sharded_offsets: tuple, singleton: bool,
                   groups: dict) -> dict:
    """Megatron's SharedExpertMLP layout; megamoe's shared expert is never tensor-parallel, so
    each rank saves whole tensors replicated over TP (the same global tensors Megatron shards)."""
    shared = layer.shared_experts
    sharded = {}
    for name, value in shared.state_dict(keep_vars=True).items():
        sharded[f"{prefix}{name}"] = make_sharded_tensor_for_checkpoint(
            value, f"{prefix}{name}", prepend_offsets=sharded_offsets, **groups)
    if layer.cfg.experts.gated:
        key = f"{prefix}linear_fc1.weight"
        sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets, singleton)
    replica_id = (0, get_pg_rank(groups["tp_group"]), get_pg_rank(groups["dp_cp_group"]))
    for name in ("linear_fc1", "linear_fc2"):
        key = f"{prefix}{name}.{EXTRA_STATE}"
        sharded[key] = make_sharded_object_for_checkpoint(None, key, sharded_offsets, replica_id)
    return sharded

