"""The bytes a rank's model state occupies, read from the objects the trainer builds: the
model's parameters (Megatron-Core DDP's parameter buffers), the gradient buffers, and the
distributed optimizer's fp32 main weights and Adam moments.

The same functions read a rank built on the meta device (the planner's prediction, counted:
`megamoe.plan.shards`) and a rank that has trained (`--measure`): storages are counted once
each, whole, by identity (`megamoe.plan.tracker.storage_bytes`).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from megamoe.plan.tracker import storage_bytes

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer"


def _optimizers(optimizer) -> Iterator:
    """The torch optimizers inside a Megatron optimizer (chained or not; stubs skipped)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is not None and not getattr(part, "is_stub_optimizer", False):
            yield part, inner


def initialise_optimizer_state(optimizer) -> None:
    """Create the optimizer's state (Adam's moments) as its first step would, without a step:
    Megatron's own `init_state_fn` (what it calls before loading a checkpoint)."""
    for part, inner in _optimizers(optimizer):
        init = getattr(part, "init_state_fn", None)
        if init is not None:
            init(inner, part.config)


def _optimizer_tensors(optimizer) -> Iterable[torch.Tensor]:
    for _, inner in _optimizers(optimizer):
        for group in inner.param_groups:
            yield from group["params"]
            for param in group["params"]:
                yield from (v for v in inner.state.get(param, {}).values()
                            if isinstance(v, torch.Tensor))


def model_state_bytes(modules: list[torch.nn.Module], optimizer) -> dict[str, int]:
    """{parameters, gradients, optimizer}: bytes of the distinct storages of the parameters,
    of their gradients (`main_grad`, Megatron DDP's buffers, and any `.grad`), and of what the
    optimizer holds besides those (fp32 main weights of bf16 parameters, Adam's moments)."""
    params = [p for module in modules for p in module.parameters()]
    param_bytes, param_keys = storage_bytes(params)
    grads = [getattr(p, "main_grad", None) for p in params] + [p.grad for p in params]
    grad_bytes, grad_keys = storage_bytes(grads, param_keys)
    optimizer_bytes, _ = storage_bytes(_optimizer_tensors(optimizer), param_keys | grad_keys)
    return {PARAMETERS: param_bytes, GRADIENTS: grad_bytes, OPTIMIZER: optimizer_bytes}


def state_storages(modules: list[torch.nn.Module]) -> set:
    """Storage keys of the parameters and gradient buffers (never counted as activations)."""
    params = [p for module in modules for p in module.parameters()]
    _, keys = storage_bytes(params)
    _, grad_keys = storage_bytes([getattr(p, "main_grad", None) for p in params])
    return keys | grad_keys
