"""The CPU training engine: micro-batch loop, gradient reduction, clipping and torch AdamW.

Megatron-Core's DDP, distributed optimizer and pipeline schedules allocate CUDA tensors, so on
CPU the same model trains through this small engine instead (data and expert parallelism over
gloo; tensor and pipeline parallelism need CUDA). It follows Megatron's conventions:
- each micro-batch's loss is its mean over unmasked tokens, divided by the number of
  micro-batches, and MoE balance losses are scaled the same way (`MoEAuxLossAutoScaler`);
- gradients are summed over data-parallel replicas and divided by the data-parallel size: dense
  parameters over the whole data-parallel group, expert parameters (`param.allreduce == False`)
  over the expert-data-parallel group only (the expert-parallel all-to-all already gathered the
  other ranks' tokens into them);
- the global gradient norm counts replicated parameters once and sharded experts on every rank.
The optimizer state is checkpointed through the model's sharded state dict
(`megatron.core.dist_checkpointing.optimizer`), so it reshards with the experts.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megamoe.errors import CheckpointError, ConfigError
from megamoe.megatron.models import causal_attention_mask
from megamoe.train.config import TrainConfig
from megamoe.train.data import Batch


def _is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: matrices decay, vectors (norms, biases) do not (as Megatron)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def _all_reduce_flat(tensors: list[torch.Tensor], group, scale: float) -> None:
    """Sum `tensors` over `group` in one collective, then multiply by `scale`, in place."""
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    for tensor, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(reduced)


class CpuEngine:
    """Trains one GPTModel on CPU with torch AdamW; see the module docstring."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig, pgs) -> None:
        if config.parallel.tensor > 1 or config.parallel.pipeline > 1:
            raise ConfigError(
                f"parallel.tensor={config.parallel.tensor}, parallel.pipeline="
                f"{config.parallel.pipeline}: on CPU only data and expert parallelism are "
                "available (gloo lacks the collectives of tensor/pipeline parallelism); set both "
                "to 1 or train on GPUs"
            )
        self.model = model
        self.pgs = pgs
        self.params = [p for p in model.parameters() if p.requires_grad]
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            weight_decay_groups(model, opt.weight_decay), lr=opt.lr,
            betas=(opt.beta1, opt.beta2), eps=opt.eps)
        self.grad_clip = config.training.grad_clip
        self.mask = causal_attention_mask(config.model.seq_length)

    def forward_backward(self, batches: Iterator[Batch], num_microbatches: int) -> torch.Tensor:
        """Forward and backward of `num_microbatches` micro-batches, then the data-parallel
        gradient reduction. Returns [sum of token losses, tokens] of this rank (detached)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / num_microbatches))
        totals = torch.zeros(2)
        for _ in range(num_microbatches):
            batch = next(batches)
            losses_BS = self.model(batch.tokens, batch.position_ids, self.mask,
                                   labels=batch.labels)
            loss_sum = (losses_BS.float() * batch.loss_mask).sum()
            tokens = batch.loss_mask.sum()
            (loss_sum / tokens.clamp(min=1) / num_microbatches).backward()
            totals += torch.stack([loss_sum.detach(), tokens])
        self._reduce_gradients()
        return totals

    def _reduce_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:  # e.g. an expert no token chose: keep every Adam step count equal
                p.grad = torch.zeros_like(p)
        dp_size = dist.get_world_size(self.pgs.dp_cp)
        dense = [p.grad for p in self.params if not _is_expert(p)]
        expert = [p.grad for p in self.params if _is_expert(p)]
        _all_reduce_flat(dense, self.pgs.dp_cp, 1.0 / dp_size)
        _all_reduce_flat(expert, self.pgs.expt_dp, 1.0 / dp_size)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients over all model shards."""
        dense_sq = torch.zeros(())
        expert_sq = torch.zeros(())
        for p in self.params:
            if _is_expert(p):
                expert_sq += p.grad.float().pow(2).sum()
            elif param_is_not_tensor_parallel_duplicate(p):
                dense_sq += p.grad.float().pow(2).sum()
        if dist.get_world_size(self.pgs.tp_ep_pp) > 1:
            dist.all_reduce(expert_sq, group=self.pgs.tp_ep_pp)
        if dist.get_world_size(self.pgs.mp) > 1:
            dist.all_reduce(dense_sq, group=self.pgs.mp)
        return (dense_sq + expert_sq).sqrt()

    def step(self, norm: torch.Tensor) -> None:
        """Clip the gradients to `training.grad_clip` (if > 0) using their norm `norm` (from
        `grad_norm`, which the loop checks first) and take an AdamW step."""
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, norm)
        self.optimizer.step()

    def model_weights_changed(self) -> None:
        """Nothing to do: AdamW updates the model's own parameters."""

    # Checkpointing --------------------------------------------------------------------------

    def optimizer_sharded_state_dict(self, model_sharded: dict, is_loading: bool) -> dict:
        """AdamW's moments as sharded tensors keyed like their parameters (so they reshard with
        the experts); the step count, equal for all parameters, as common state."""
        if is_loading:
            self._init_state()
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values()}
        if len(steps) > 1:
            raise CheckpointError(f"AdamW step counts differ between parameters ({steps})")
        id_map = get_param_id_to_sharded_param_map(model_sharded, self._params_in_order())
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        return {"torch_adamw": state, "step": steps.pop() if steps else 0.0}

    def load_optimizer_state_dict(self, loaded: dict) -> None:
        state = loaded["torch_adamw"]
        for param_state in state["state"].values():
            param_state["step"] = torch.tensor(float(loaded["step"]))
        # Hyperparameters come from the current config; the schedule sets the rate each step.
        state["param_groups"] = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict(state)

    def _params_in_order(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _init_state(self) -> None:
        """Zero moments for every parameter, the shape AdamW's state has after its first step."""
        for p in self._params_in_order():
            self.optimizer.state[p] = {"step": torch.tensor(0.0),
                                       "exp_avg": torch.zeros_like(p),
                                       "exp_avg_sq": torch.zeros_like(p)}
