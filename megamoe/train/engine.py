"""The training engine, on CPU and GPU alike: Megatron-Core's DistributedDataParallel (gradient
buffers), distributed optimizer, pipeline schedules and `finalize_model_grads`.

Each model chunk (one per virtual pipeline stage; bf16 through Megatron's Float16Module, or fp32)
is wrapped in Megatron-Core's DistributedDataParallel: expert parameters
(`param.allreduce == False`) reduce over the expert-data-parallel group, the rest over the
data-parallel group, and the distributed optimizer (Adam with fp32 main weights, sharded over
data-parallel ranks) updates them; with `optimizer.name: muon`, Muon and Adam in Megatron's
non-distributed wrappers over all-reduced gradients, each rank updating the whole parameters it
owns (`megamoe.train.muon_optimizer`). Its step
is taken in two halves (`grad_norm`, `step`) so the loop's divergence guards see the clipped
global norm before any weight changes. Micro-batches run
through `get_forward_backward_func()` (no pipelining, 1F1B, or interleaved 1F1B with virtual
stages), whose `finalize_model_grads` finishes the gradient reduction (data-parallel
reduce-scatter, sequence-parallel and tied-embedding all-reduces). Megatron's conventions: a
micro-batch's loss is its mean over unmasked tokens divided by the number of micro-batches, and
MoE balance losses and the multi-token-prediction losses (each depth's mean over its tokens,
times `model.mtp_loss_weight` / D) are scaled alike (`MoEAuxLossAutoScaler`,
`MTPLossAutoScaler`, set by the schedule). Every layer's
dropout and router jitter draw from streams of (seed, step, micro-batch, layer)
(`megamoe.megatron.layer_seeds`), so pipeline, expert and data parallelism do not change them.

On CPU the same components run under `megamoe.megatron.cpu.cuda_as_cpu` (their CUDA
allocations land on the CPU; collectives and point-to-point go over gloo). The optimizer state
is checkpointed in the `fully_reshardable` layout, keyed by the model's sharded keys, so it
reshards with every parallel size.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, ContextManager, Iterator, Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.optimizer import param_group_identifier_keys
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from megamoe.megatron.compat import reset_mtp_losses, take_mtp_losses
from megamoe.megatron.cpu import cuda_as_cpu
from megamoe.megatron.layer_seeds import LayerSeeds
from megamoe.megatron.masks import attention_mask_for
from megamoe.train.config import TrainConfig
from megamoe.train.data import Batch
from megamoe.train.muon_optimizer import muon_optimizer
from megamoe.train.qk_clip import QKClip
from megamoe.train.routing_records import RoutingRecords

# Keys of the optimizer state are the parameters' own (no `chained_N.` prefix): the number and
# order of chained optimizers differ between layouts (a stage without experts has an empty one).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable",
                      "chained_optim_avoid_prefix": True}


def _lm_loss(loss_mask_BS: torch.Tensor, losses_BS: torch.Tensor):
    """Megatron's 3-tuple loss contract: (summed loss, tokens, report); the schedule divides by
    the tokens and the number of micro-batches."""
    loss_sum = (losses_BS.float() * loss_mask_BS).sum()
    tokens = loss_mask_BS.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), tokens.float()])
    return loss_sum, tokens, {"lm_loss": report}


class Engine:
    """Trains this rank's model chunks (one per virtual pipeline stage); see the module
    docstring. `chunks` are GPTModels on the CPU; on CUDA they are moved to this rank's GPU."""

    def __init__(self, chunks: list[torch.nn.Module], tc: TransformerConfig,
                 config: TrainConfig, on_cuda: bool, routes_prompt: bool = False,
                 device_context: Optional[Callable[[], ContextManager]] = None) -> None:
        self.config = config
        self.on_cuda = on_cuda
        # Where Megatron's components allocate; the memory planner passes `cuda_as_meta`.
        self._device_context = device_context
        self.routes_prompt = routes_prompt
        self.mask = attention_mask_for(config.model.seq_length, on_cuda)
        self.layer_seeds = LayerSeeds(chunks, config.training.seed)
        self._step = 0
        self._forwards: list[int] = []
        self.routing: Optional[RoutingRecords] = None
        """Set by the loop under training.routing_record / routing_replay."""
        with self.device_context():
            if on_cuda:
                for chunk in chunks:
                    chunk.cuda(torch.cuda.current_device())
            opt = config.optimizer
            # Muon orthogonalises whole matrices: gradients all-reduced, no flat sharding
            # (megamoe.train.muon_optimizer).
            distributed = opt.name != "muon"
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                       use_distributed_optimizer=distributed,
                                                       overlap_grad_reduce=False)
            self.ddp = [DistributedDataParallel(
                config=tc, ddp_config=ddp_config,
                module=Float16Module(tc, chunk) if tc.bf16 else chunk,
                # Only the first chunk's buckets may skip padding (as Megatron-LM).
                disable_bucketing=index > 0) for index, chunk in enumerate(chunks)]
            adam = OptimizerConfig(optimizer="adam", lr=opt.lr, min_lr=opt.min_lr,
                                   weight_decay=opt.weight_decay, adam_beta1=opt.beta1,
                                   adam_beta2=opt.beta2, adam_eps=opt.eps, bf16=tc.bf16,
                                   params_dtype=tc.params_dtype,
                                   use_distributed_optimizer=distributed,
                                   clip_grad=config.training.grad_clip)
            self.optimizer = (get_megatron_optimizer(adam, self.ddp) if distributed
                              else muon_optimizer(opt, adam, self.ddp))
        threshold = config.optimizer.qk_clip_threshold
        self.qk_clip = QKClip(chunks, threshold) if threshold is not None else None
        tc.grad_scale_func = self.optimizer.scale_loss
        no_sync = [ddp.no_sync for ddp in self.ddp]
        tc.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        tc.finalize_model_grads_func = finalize_model_grads
        self.forward_backward_func = get_forward_backward_func()
        reset_mtp_losses()  # Megatron's per-depth record, sized for this model when it starts

    def device_context(self):
        """Where Megatron-Core's training components run: as they are on CUDA, under
        `cuda_as_cpu` on the CPU."""
        if self._device_context is not None:
            return self._device_context()
        return contextlib.nullcontext() if self.on_cuda else cuda_as_cpu()

    def _forward_step(self, data_iterator: Iterator[Batch], model: torch.nn.Module):
        batch = next(data_iterator)
        # This chunk's k-th forward of the step is micro-batch k of this data-parallel rank.
        chunk = self.ddp.index(model)
        local, self._forwards[chunk] = self._forwards[chunk], self._forwards[chunk] + 1
        microbatch = (local * parallel_state.get_data_parallel_world_size()
                      + parallel_state.get_data_parallel_rank())
        self.layer_seeds.start_microbatch(self._step, microbatch)
        if self.on_cuda:
            batch = type(batch)(*(t.cuda(non_blocking=True) for t in batch))
        # A router that reads the prompt (SIMoE's) gets the instruction batch's prompt mask.
        prompt = {"prompt_mask": batch.prompt_mask} if self.routes_prompt else {}
        if self.routing is not None:
            self.routing.before_forward(chunk, microbatch)
        losses_BS = model(batch.tokens, batch.position_ids, self.mask, labels=batch.labels,
                          **prompt)
        if self.routing is not None:
            self.routing.after_forward(chunk, microbatch)
        return losses_BS, partial(_lm_loss, batch.loss_mask)

    def forward_backward(self, batches: Iterator[Batch], num_microbatches: int, step: int
                         ) -> torch.Tensor:
        """All micro-batches of optimizer step `step` through Megatron's schedule (gradients
        finalised).
        Returns [sum of token losses, tokens, then per multi-token-prediction depth the sum of
        its micro-batches' mean losses] of this rank: zeros off the last pipeline stage and
        on tensor-parallel ranks but the first (they hold the same loss), so the sum over all
        ranks counts every token (and micro-batch) once. Every model chunk reads the step's
        micro-batches (a pipeline stage uses what it needs: the first the tokens, the last the
        labels)."""
        step_batches = [next(batches) for _ in range(num_microbatches)]
        self._step, self._forwards = step, [0] * len(self.ddp)
        if self.routing is not None:
            self.routing.start_step(step)
        for ddp in self.ddp:
            ddp.train()
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        t = self.config.training
        with self.device_context():
            reports = self.forward_backward_func(
                forward_step_func=self._forward_step,
                data_iterator=[iter(step_batches) for _ in self.ddp],
                model=self.ddp, num_microbatches=num_microbatches,
                seq_length=self.config.model.seq_length, micro_batch_size=t.micro_batch_size,
                forward_only=False)
        if self.routing is not None:
            self.routing.end_step()
        totals = torch.zeros(2 + self.config.model.mtp_layers)
        mtp = take_mtp_losses() if self.config.model.mtp_layers else None
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            for report in reports:
                totals[:2] += report["lm_loss"].float().cpu()
            if mtp is not None:
                totals[2:] += mtp
        return totals

    def grad_norm(self) -> torch.Tensor:
        """Copy the reduced gradients to the fp32 main gradients and return their global norm
        (the first half of Megatron's `optimizer.step()`; the loop checks it before `step`)."""
        with self.device_context():
            self.optimizer.prepare_grads()  # bf16 or fp32: no loss scaler, nothing to skip
            return torch.as_tensor(self.optimizer.get_grad_norm(), dtype=torch.float32).cpu()

    def step(self, norm: torch.Tensor) -> dict[str, float]:
        """The second half of Megatron's `optimizer.step()`: clip every chained optimizer's main
        gradients by the global norm `norm` (as `ChainedOptimizer.step`), then update; with
        `optimizer.qk_clip_threshold`, MuonClip's QK-clip after the update, returning each
        layer's max attention logit of the step (megamoe.train.qk_clip), else {}."""
        with self.device_context():
            if self.config.training.grad_clip > 0:
                for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                    parameters = optimizer.get_parameters()
                    if parameters and not getattr(optimizer, "is_stub_optimizer", False):
                        clip_grad_by_total_norm_fp32(parameters, self.config.training.grad_clip,
                                                     float(norm))
            self.optimizer.step_with_ready_grads()
            if self.qk_clip is not None:
                return self.qk_clip.apply(self.optimizer)
        return {}

    def model_weights_changed(self) -> None:
        """Copy freshly loaded model weights into the optimizer's fp32 main weights."""
        with self.device_context():
            self.optimizer.reload_model_params()

    def optimizer_sharded_state_dict(self, model_sharded: dict, is_loading: bool) -> dict:
        with self.device_context():
            return self.optimizer.sharded_state_dict(model_sharded, is_loading=is_loading,
                                                     metadata=OPTIMIZER_SHARDING)

    def load_optimizer_state_dict(self, loaded: dict) -> None:
        """Load the optimizer's saved state; its parameter groups keep this run's schedule
        values (`with_run_schedule`)."""
        with_run_schedule(loaded, self.optimizer.param_groups)
        with self.device_context():
            self.optimizer.load_state_dict(loaded)


# The schedule values Megatron-Core keeps in each parameter group (its ParamGroupOverride), which
# from megatron-core 0.19 also pair saved groups with the run's. They are settings of the run
# (optimizer.lr, min_lr, weight decay) that a resume may change, e.g. rewinding past a loss spike
# at a lower learning rate, as Megatron-LM users do.
SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def with_run_schedule(saved: object, run_groups: list[dict]) -> None:
    """Give every parameter group in the saved optimizer state `saved` (nested as Megatron-Core
    saves it: any dict holding `param_groups`) the schedule values of the run's group with the
    same structure (the other keys Megatron-Core pairs groups by), in place."""
    def structure(group: dict) -> tuple:
        return tuple(group.get(key) for key in param_group_identifier_keys
                     if key not in SCHEDULE_KEYS)

    schedules = {structure(group): {key: group[key] for key in SCHEDULE_KEYS if key in group}
                 for group in run_groups}
    if isinstance(saved, dict):
        for group in saved.get("param_groups", ()):
            if isinstance(group, dict):
                group.update(schedules.get(structure(group), {}))
        for value in saved.values():
            if isinstance(value, (dict, list)):
                with_run_schedule(value, run_groups)
    elif isinstance(saved, list):
        for value in saved:
            with_run_schedule(value, run_groups)
