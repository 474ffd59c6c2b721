"""Muon in the trainer (`optimizer.name: muon`): megamoe's `Muon` for the hidden matrices,
Megatron-Core's Adam for the rest, in Megatron-Core's optimizer wrappers and one
`ChainedOptimizer`, as Megatron-Core's own `optimizer/muon.py` chains them (that one needs
NVIDIA's Emerging-Optimizers package, which is not installable from PyPI).

Layouts: Muon orthogonalises whole matrices, which the distributed optimizer's flat shards of
the gradient buffer are not (a shard may cut a matrix anywhere). So a Muon run uses Megatron's
non-distributed wrappers (FP32Optimizer, or Float16OptimizerWithFloat16Params with fp32 main
weights under bf16) over all-reduced gradients: DistributedDataParallel all-reduces them (the
expert weights over the expert-data-parallel group). Expert parallelism keeps each expert whole
on its rank (per-expert matrices need no communication). Tensor-parallel shards gather their
momentum over the tensor-parallel group and orthogonalise the full matrix
(`megamoe.optim.muon.orthogonalised`).

Data parallelism, `optimizer.muon.distributed` (default): the optimizer state is sharded by
whole parameters, as Megatron-Core's layer-wise distributed optimizer shards it for Muon
(`LayerWiseDistributedOptimizer`). Each parameter, Muon's and Adam's alike, has one owner in its
data-parallel group (the expert-data-parallel group for expert weights), balanced by size
(`megamoe.optim.sharding.balanced_owners`); a rank's optimizers hold only what it owns (fp32
main weights, Muon's momentum, Adam's moments), so it holds about 1/DP of the state. Each rank
updates (orthogonalises) only its own parameters from the reduced gradients, then every owner
broadcasts its updated parameters to its group (`ShardedMuonChain.step_with_ready_grads`). The
gradient norm sums every rank's own parameters over all ranks. The updates are the replicated
version's: the same arithmetic on the same gradients, done once instead of on every rank.
`distributed: false`: every data-parallel rank holds the whole state and computes the same
update (the memory of the state times DP).

Chain, the same on every rank and layout (so checkpoints reshard): [Muon over non-expert
matrices, Muon over expert matrices (their gradient statistics over the tensor x expert x
pipeline group, as Megatron's expert optimizers), Megatron's Adam for the AdamW parameters].
A rank without some of them (a pipeline stage of dense layers, a data-parallel rank that owns
no expert matrix) has an empty group there. Checkpoints (`ShardedMuonChain.sharded_state_dict`)
key each state tensor by its parameter's sharded key, as Adam's (`optimizer.state.<name>.<key>`),
written by the parameter's owner, so they reshard across data- and expert-parallel sizes and
between the two settings; the parameter groups are not saved (each step sets them from the
config: `schedule.apply_step_settings`), and the step count is saved once.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from megatron.core.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megamoe.optim.muon import Muon, init_state
from megamoe.optim.params import split_parameters
from megamoe.optim.sharding import balanced_owners
from megamoe.train.settings.optimizer import OptimizerConfig as OptimizerSettings


def _init_momentum(optimizer: torch.optim.Optimizer, config=None) -> None:
    """Give every parameter its initial Muon state, so a checkpoint loads into it."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            init_state(optimizer.state[param], param)


def _muon(pairs: list, is_expert: bool, settings: OptimizerSettings, config: OptimizerConfig,
          stats_group, tp_group):
    """One Megatron-wrapped Muon over (parameter, Matrix) `pairs`, one parameter group."""
    muon = settings.muon
    group = {"params": [param for param, _ in pairs], "matrices": [m for _, m in pairs],
             # The keys Megatron-Core pairs saved and current groups by, and its schedule's.
             "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": is_expert,
             "is_decoupled_lr": False, "default_config": True,
             "max_lr": settings.lr, "min_lr": settings.min_lr}
    optimizer = Muon([group], lr=settings.lr, momentum=muon.momentum, nesterov=muon.nesterov,
                     weight_decay=settings.weight_decay, ns_steps=muon.ns_steps,
                     ns_coefficients=muon.ns_coefficients, scale=muon.scale, tp_group=tp_group)
    if config.bf16:
        wrapped = Float16OptimizerWithFloat16Params(optimizer, config, None, _init_momentum)
    else:
        wrapped = FP32Optimizer(optimizer, config, _init_momentum)
    wrapped.grad_stats_parallel_group = stats_group
    wrapped.tp_group = tp_group
    return wrapped


class Shards(NamedTuple):
    """A data-parallel process group and the parameters each of its ranks owns."""

    group: object
    params_by_rank: list[list[torch.nn.Parameter]]


def _trainable(chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The chunks' trainable parameters, each once, in model order."""
    seen, out = set(), []
    for chunk in chunks:
        for param in chunk.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    return out


def data_parallel_shards(params: list[torch.nn.Parameter]) -> list[Shards]:
    """Each parameter's owner (`balanced_owners` by element count): non-expert parameters over
    the data-parallel group (with context parallelism, over which DDP reduces their
    gradients), expert parameters over the expert-data-parallel group."""
    groups = ((True, parallel_state.get_data_parallel_group(with_context_parallel=True)),
              (False, parallel_state.get_expert_data_parallel_group()))
    shards = []
    for allreduce, group in groups:
        members = [p for p in params if getattr(p, "allreduce", True) == allreduce]
        size = dist.get_world_size(group)
        owners = balanced_owners([p.numel() for p in members], size)
        shards.append(Shards(group, [[p for p, owner in zip(members, owners) if owner == rank]
                                     for rank in range(size)]))
    return shards


def _owned(shards: list[Shards]) -> set[int]:
    return {id(p) for shard in shards for p in shard.params_by_rank[dist.get_rank(shard.group)]}


def muon_optimizer(settings: OptimizerSettings, config: OptimizerConfig,
                   chunks: list[torch.nn.Module]) -> "ShardedMuonChain":
    """The chained optimizer of a Muon run over DistributedDataParallel `chunks` (built with
    `use_distributed_optimizer=False`); `config` is Megatron's Adam config for the AdamW part
    (non-distributed). With `optimizer.muon.distributed`, over this rank's own parameters."""
    trainable = _trainable(chunks)
    shards = data_parallel_shards(trainable) if settings.muon.distributed else None
    owned = _owned(shards) if shards is not None else {id(p) for p in trainable}
    pairs = [pair for chunk in chunks for pair in split_parameters(chunk)[0]]
    muon_ids = {id(param) for param, _ in pairs}
    mine = [(p, m) for p, m in pairs if id(p) in owned]
    dense = [(p, m) for p, m in mine if getattr(p, "allreduce", True)]
    experts = [(p, m) for p, m in mine if not getattr(p, "allreduce", True)]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    chain = [_muon(dense, False, settings, config, parallel_state.get_model_parallel_group(),
                   tp_group),
             _muon(experts, True, settings, config,
                   parallel_state.get_expert_tensor_model_pipeline_parallel_group(), tp_group)]
    # Megatron's Adam takes every trainable parameter: hide Muon's, and those of other owners,
    # while it collects them.
    hidden = [p for p in trainable if id(p) in muon_ids or id(p) not in owned]
    for param in hidden:
        param.requires_grad_(False)
    try:
        adam = get_megatron_optimizer(config, chunks) if len(trainable) > len(hidden) else None
    finally:
        for param in hidden:
            param.requires_grad_(True)
    adams = [] if adam is None else getattr(adam, "chained_optimizers", [adam])
    return ShardedMuonChain(chain + adams, shards)


def _grads_for_norm(optimizer) -> list[torch.Tensor]:
    """The main gradients an optimizer counts in the norm (each once over tensor parallelism;
    the method's name differs between megatron-core 0.16 and 0.19)."""
    method = getattr(optimizer, "get_main_grads_for_grad_norm", None)
    return method() if method is not None else optimizer.get_grads_for_grad_norm()


def _broadcast_owned(shards: Shards) -> None:
    """Every owner in `shards.group` sends its updated parameters to the others."""
    group = shards.group
    if dist.get_world_size(group) == 1:
        return
    me = dist.get_rank(group)
    for owner, params in enumerate(shards.params_by_rank):
        for dtype in sorted({p.dtype for p in params}, key=str):
            same = [p for p in params if p.dtype == dtype]
            flat = (_flatten_dense_tensors([p.data for p in same]) if owner == me else
                    torch.empty(sum(p.numel() for p in same), dtype=dtype,
                                device=same[0].device))
            dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
            if owner != me:
                for param, value in zip(same, _unflatten_dense_tensors(flat, same)):
                    param.data.copy_(value)


def _saved_step(loaded: dict) -> float:
    """The optimizer step count of a loaded state: this chain's `step`, or (a checkpoint of the
    chain before its steps were saved once) the largest `common_step` Megatron's wrappers saved."""
    if "step" in loaded:
        return float(loaded["step"])

    def found(value) -> list[float]:
        if not isinstance(value, dict):
            return []
        here = [float(value["common_step"])] if "common_step" in value else []
        return here + [step for inner in value.values() for step in found(inner)]

    return max(found(loaded), default=0.0)


def _unwrapped(params):
    return params.unwrap() if isinstance(params, LocalNonpersistentObject) else params


class ShardedMuonChain(ChainedOptimizer):
    """The Muon run's `ChainedOptimizer`; with `shards` (`optimizer.muon.distributed`), each
    chained optimizer holds only this rank's parameters (see the module docstring)."""

    def __init__(self, chained_optimizers: list, shards: Optional[list[Shards]]) -> None:
        super().__init__(chained_optimizers)
        self.shards = shards

    @torch.no_grad()
    def get_grad_norm(self):
        """The global gradient norm: with shards, every rank's own parameters summed over all
        ranks (each parameter has one owner in its data-parallel group)."""
        if self.shards is None:
            return super().get_grad_norm()
        grads = [g for optimizer in self.chained_optimizers for g in _grads_for_norm(optimizer)]
        return get_grad_norm_fp32(grads, grad_stats_parallel_group=None)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Update this rank's parameters; with shards, then every owner broadcasts its own."""
        success = super().step_with_ready_grads()
        for shards in self.shards or ():
            _broadcast_owned(shards)
        return success

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           **kwargs) -> dict:
        """{"chains": each chained optimizer's sharded state (tensors keyed by their
        parameters' keys; parameter groups local, never saved), "step": the step count}. With
        shards, each state tensor is written by its owner (data-parallel replica 0)."""
        chains, steps = {}, [0.0]
        for index, optimizer in enumerate(self.chained_optimizers):
            sharded = optimizer.sharded_state_dict(model_sharded_state_dict, is_loading,
                                                   **kwargs)
            inner = sharded.get("optimizer", sharded)
            step = inner["state"].pop("common_step", None)
            if step is not None:
                steps.append(float(step))
            inner["param_groups"] = LocalNonpersistentObject(
                [{**group, "params": _unwrapped(group["params"])}
                 for group in inner["param_groups"]])
            if "fp32_from_fp16_params" in sharded:
                sharded["fp32_from_fp16_params"] = {
                    i: group if group else LocalNonpersistentObject(group)
                    for i, group in enumerate(sharded["fp32_from_fp16_params"])}
            chains[index] = sharded
        if self.shards is not None:
            for value in nested_values(chains):
                if hasattr(value, "replica_id"):
                    value.replica_id = (0 if isinstance(value.replica_id, int)
                                        else (*value.replica_id[:-1], 0))
        step = torch.tensor([max(steps)],
                            device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        return {"chains": chains, "step": step[0].cpu()}

    def load_state_dict(self, state_dict: dict) -> None:
        step = torch.tensor(_saved_step(state_dict))
        for index, optimizer in enumerate(self.chained_optimizers):
            loaded = state_dict["chains"][index]
            inner = loaded.get("optimizer", loaded)
            inner.setdefault("state", {})["common_step"] = step
            if "fp32_from_fp16_params" in loaded:
                loaded["fp32_from_fp16_params"] = [
                    group for _, group in sorted(loaded["fp32_from_fp16_params"].items())]
            optimizer.load_state_dict(loaded)
