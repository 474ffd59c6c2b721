"""The learning-rate schedule: linear warm-up, then cosine, linear or constant decay to `min_lr`.

The rate is a pure function of the optimizer step, so a resumed run continues the schedule
exactly from its iteration count and a checkpoint needs no scheduler state beyond it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megamoe.train.config import OptimizerConfig


@dataclass(frozen=True)
class LRSchedule:
    """Warm-up over `warmup_steps` from lr/warmup_steps to `lr`, then `style` decay over
    `decay_steps` to `min_lr` (cosine as in SGDR, Loshchilov & Hutter, arXiv 1608.03983), then
    `min_lr` to the end."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    style: str

    @classmethod
    def from_config(cls, optimizer: OptimizerConfig, train_steps: int) -> "LRSchedule":
        decay = optimizer.decay_steps or max(1, train_steps - optimizer.warmup_steps)
        return cls(optimizer.lr, optimizer.min_lr, optimizer.warmup_steps, decay,
                   optimizer.decay_style)

    def __call__(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1 for the first step)."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.style == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        if self.style == "linear":
            fraction = 1.0 - progress
        else:
            fraction = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * fraction


def apply_step_settings(optimizer, settings: OptimizerConfig, lr: float) -> None:
    """Each parameter group's settings for a step, as Megatron-LM's `OptimizerParamScheduler`
    sets them: the rate `lr` x the group's `lr_mult` and the weight decay x its `wd_mult`
    (Megatron-Core gives biases and 1-D parameters, e.g. norm weights, `wd_mult` 0); and Adam's
    betas and eps. All come from the run's config every step, so a resumed run steps with what
    its config says, not with the values its checkpoint's parameter groups carried (Muon keeps
    its own settings the same way, `Muon.load_state_dict`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = settings.weight_decay * group.get("wd_mult", 1.0)
        if "betas" in group:
            group["betas"] = (settings.beta1, settings.beta2)
        if "eps" in group:
            group["eps"] = settings.eps
