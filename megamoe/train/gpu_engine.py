"""The GPU training engine: Megatron-Core's own DDP, distributed optimizer and pipeline schedules.

The model (bf16 through Megatron's Float16Module, or fp32) is wrapped in Megatron-Core's
DistributedDataParallel: expert parameters (`param.allreduce == False`) reduce over the
expert-data-parallel group, the rest over the data-parallel group. The distributed optimizer
(Adam with fp32 main weights, sharded over data-parallel ranks) clips the global gradient norm;
its step is taken in two halves (`grad_norm`, `step`) so the loop's divergence guards see the
norm before any weight changes.
Micro-batches run through `get_forward_backward_func()` (1F1B when pipeline-parallel), whose
`finalize_model_grads` finishes the gradient reduction. Its optimizer state is checkpointed in the
`fully_reshardable` layout, keyed by the model's sharded keys, so it reshards with the experts.
"""
from __future__ import annotations

from functools import partial
from typing import Iterator

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from megamoe.train.config import TrainConfig
from megamoe.train.data import Batch

OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _lm_loss(loss_mask_BS: torch.Tensor, losses_BS: torch.Tensor):
    """Megatron's 3-tuple loss contract: (summed loss, tokens, report); the schedule divides by
    the tokens and the number of micro-batches."""
    loss_sum = (losses_BS.float() * loss_mask_BS).sum()
    tokens = loss_mask_BS.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), tokens.float()])
    return loss_sum, tokens, {"lm_loss": report}


class GpuEngine:
    """Trains one GPTModel pipeline stage on this rank's GPU; see the module docstring."""

    def __init__(self, model: torch.nn.Module, tc: TransformerConfig, config: TrainConfig,
                 pgs) -> None:
        self.model = model
        self.config = config
        model.cuda(torch.cuda.current_device())
        wrapped = Float16Module(tc, model) if tc.bf16 else model
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=True,
                                                   overlap_grad_reduce=False)
        self.ddp = DistributedDataParallel(config=tc, ddp_config=ddp_config, module=wrapped)
        opt = config.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=opt.lr, min_lr=opt.min_lr,
                            weight_decay=opt.weight_decay, adam_beta1=opt.beta1,
                            adam_beta2=opt.beta2, adam_eps=opt.eps, bf16=tc.bf16,
                            params_dtype=tc.params_dtype, use_distributed_optimizer=True,
                            clip_grad=config.training.grad_clip),
            [self.ddp])
        tc.grad_scale_func = self.optimizer.scale_loss
        tc.no_sync_func = self.ddp.no_sync
        tc.finalize_model_grads_func = finalize_model_grads
        self.forward_backward_func = get_forward_backward_func()

    def _forward_step(self, data_iterator: Iterator[Batch], model: torch.nn.Module):
        batch = next(data_iterator)
        cuda = {name: t.cuda(non_blocking=True) for name, t in batch._asdict().items()}
        losses_BS = model(cuda["tokens"], cuda["position_ids"], None, labels=cuda["labels"])
        return losses_BS, partial(_lm_loss, cuda["loss_mask"])

    def forward_backward(self, batches: Iterator[Batch], num_microbatches: int) -> torch.Tensor:
        """All micro-batches of one step through Megatron's schedule (gradients finalised).
        Returns [sum of token losses, tokens] of this rank (zeros off the last pipeline stage)."""
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self.forward_backward_func(
            forward_step_func=self._forward_step, data_iterator=batches, model=[self.ddp],
            num_microbatches=num_microbatches, seq_length=self.config.model.seq_length,
            micro_batch_size=self.config.training.micro_batch_size, forward_only=False)
        totals = torch.zeros(2)
        for report in reports:
            totals += report["lm_loss"].float().cpu()
        return totals

    def grad_norm(self) -> torch.Tensor:
        """Copy the reduced gradients to the fp32 main gradients and return their global norm
        (the first half of Megatron's `optimizer.step()`; the loop checks it before `step`)."""
        self.optimizer.prepare_grads()  # bf16 or fp32: no loss scaler, nothing to skip
        return torch.as_tensor(self.optimizer.get_grad_norm(), dtype=torch.float32)

    def step(self, norm: torch.Tensor) -> None:
        """The second half of Megatron's `optimizer.step()`: clip every chained optimizer's main
        gradients by the global norm `norm` (as `ChainedOptimizer.step`), then update."""
        if self.config.training.grad_clip > 0:
            for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                parameters = optimizer.get_parameters()
                if parameters and not getattr(optimizer, "is_stub_optimizer", False):
                    clip_grad_by_total_norm_fp32(parameters, self.config.training.grad_clip,
                                                 float(norm))
        self.optimizer.step_with_ready_grads()

    def model_weights_changed(self) -> None:
        """Copy freshly loaded model weights into the optimizer's fp32 main weights."""
        self.optimizer.reload_model_params()

    def optimizer_sharded_state_dict(self, model_sharded: dict, is_loading: bool) -> dict:
        return self.optimizer.sharded_state_dict(model_sharded, is_loading=is_loading,
                                                 metadata=OPTIMIZER_SHARDING)

    def load_optimizer_state_dict(self, loaded: dict) -> None:
        self.optimizer.load_state_dict(loaded)
