"""Muon in the trainer (`optimizer.name: muon`): megamoe's `Muon` for the hidden matrices,
Megatron-Core's Adam for the rest, in Megatron-Core's optimizer wrappers and one
`ChainedOptimizer`, as Megatron-Core's own `optimizer/muon.py` chains them (that one needs
NVIDIA's Emerging-Optimizers package, which is not installable from PyPI).

Layouts: Muon orthogonalises whole matrices, which the distributed optimizer's flat shards of
the gradient buffer are not (a shard may cut a matrix anywhere). So a Muon run uses Megatron's
non-distributed wrappers (FP32Optimizer, or Float16OptimizerWithFloat16Params with fp32 main
weights under bf16): DistributedDataParallel all-reduces the gradients (the expert weights over
the expert-data-parallel group) and every data-parallel rank computes the same update from the
same reduced gradient, so data parallelism changes nothing. Expert parallelism keeps each
expert whole on its rank (per-expert matrices need no communication). Tensor-parallel shards
gather their momentum over the tensor-parallel group and orthogonalise the full matrix
(`megamoe.optim.muon.orthogonalised`). The cost: every data-parallel rank holds the full
optimizer state (momentum, and Adam's moments for the AdamW part) instead of a 1/DP shard.
Megatron-Core's layer-wise alternative (each rank updates whole layers and broadcasts them)
saves that memory at the price of a broadcast per step; not done here.

Chain, the same on every rank and layout (so checkpoints reshard): [Muon over non-expert
matrices, Muon over expert matrices (their gradient statistics over the tensor x expert x
pipeline group, as Megatron's expert optimizers), Megatron's Adam for the AdamW parameters].
A rank without expert matrices (a pipeline stage of dense layers) has an empty group there.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)

from megamoe.optim.muon import Muon, init_state
from megamoe.optim.params import split_parameters
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


def muon_optimizer(settings: OptimizerSettings, config: OptimizerConfig,
                   chunks: list[torch.nn.Module]) -> ChainedOptimizer:
    """The chained optimizer of a Muon run over DistributedDataParallel `chunks` (built with
    `use_distributed_optimizer=False`); `config` is Megatron's Adam config for the AdamW part
    (non-distributed)."""
    pairs = [pair for chunk in chunks for pair in split_parameters(chunk)[0]]
    dense = [(p, m) for p, m in pairs if getattr(p, "allreduce", True)]
    experts = [(p, m) for p, m in pairs if not getattr(p, "allreduce", True)]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    chain = [_muon(dense, False, settings, config, parallel_state.get_model_parallel_group(),
                   tp_group),
             _muon(experts, True, settings, config,
                   parallel_state.get_expert_tensor_model_pipeline_parallel_group(), tp_group)]
    # Megatron's Adam takes every trainable parameter: hide Muon's while it collects them.
    for param, _ in pairs:
        param.requires_grad_(False)
    try:
        adam = get_megatron_optimizer(config, chunks)
    finally:
        for param, _ in pairs:
            param.requires_grad_(True)
    return ChainedOptimizer(chain + adam.chained_optimizers)
