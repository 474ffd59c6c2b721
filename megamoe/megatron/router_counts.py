"""A megamoe router as Megatron-Core's finalize_model_grads expects to find one.

With `moe_router_enable_expert_bias`, Megatron-Core updates the expert biases itself
(`_update_router_expert_bias`, once per step): it duck-types routers by their `expert_bias` and
`local_tokens_per_expert` buffers, stacks the buffers of every router it finds and applies
`b += u * sign(mean(c) - c)`, then zeroes the counts (`reset_model_temporary_tensors`); with
`global_aux_loss` it calls `reset_global_aux_loss_tracker()` once per step.
`megatron_router(cls)` gives a megamoe router class its step owner (`megamoe.balancing.owner`,
decided by the layer's builder) and, when that owner is `FINALIZE_MODEL_GRADS`, that contract:

- `local_tokens_per_expert`: the step's selections per expert, added at every counted forward;
- both buffers of width W = `bias_width` (the widest router of a model with different expert
  counts), because Megatron stacks them: the counts then hold E * c_i for the real experts and
  sum(c) in the padding, so Megatron's rule computes exactly u * sign(mean(c) - c_i) for the real
  experts and leaves the padding at 0. The state dict holds the real [E] bias only.
Quantile balancing (`moe_router_load_balancing_type` `quantile_balancing`, megatron-core 0.19) is
updated there too (`_update_router_qb_beta`): Megatron finds routers by a `qb_beta_accum` that
is not None, averages `qb_beta_accum / qb_beta_count` over the data-parallel group into
`qb_beta` and zeroes the two. A router whose quantile bias belongs to finalize_model_grads
shows its estimates under those names (and only then: Megatron zeroes any it finds).
`step_balancing` then leaves the bias to Megatron (`StepOwner.bias_by_step_balancing`).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from megamoe.balancing.owner import StepOwner
from megamoe.errors import ConfigError
from megamoe.routing import Router, Routing


class MegatronRouterCounts:
    """Mixin over a megamoe `Router` class (see the module docstring)."""

    def __init__(self, cfg, init_method=None, bias_width: Optional[int] = None,
                 step_owner: StepOwner = StepOwner.STEP_BALANCING):
        super().__init__(cfg, init_method)
        self.step_owner = step_owner
        if (self.quantile_beta_E is not None and step_owner is StepOwner.FINALIZE_MODEL_GRADS
                and bias_width not in (None, cfg.num_experts)):
            raise ConfigError(
                f"num_experts={cfg.num_experts} in a model whose widest MoE layer has {bias_width}"
                ": Megatron's finalize_model_grads updates quantile balancing's biases stacked, "
                "so every quantile-balanced layer needs the same number of experts")
        if self.bias_E is None or step_owner is not StepOwner.FINALIZE_MODEL_GRADS:
            return
        E = cfg.num_experts
        width = bias_width or E
        if width < E:
            raise ConfigError(f"bias_width={width} is below num_experts={E}")
        self.expert_bias = torch.zeros(width, dtype=torch.float32)
        self.register_buffer("local_tokens_per_expert", torch.zeros(width, dtype=torch.float32),
                             persistent=False)

    @property
    def qb_beta_accum(self) -> Optional[torch.Tensor]:
        """The step's summed quantile estimates, when finalize_model_grads updates the bias."""
        return self.quantile_sum if self._quantile_by_megatron else None

    @property
    def qb_beta_count(self) -> Optional[torch.Tensor]:
        """The number of estimates in `qb_beta_accum`, when finalize_model_grads updates the
        bias."""
        return self.quantile_batches if self._quantile_by_megatron else None

    @property
    def _quantile_by_megatron(self) -> bool:
        return (self.quantile_beta_E is not None
                and self.step_owner is StepOwner.FINALIZE_MODEL_GRADS)

    @property
    def bias_E(self) -> Optional[torch.Tensor]:
        """The router's bias [E] (a view of the padded buffer)."""
        bias = getattr(self, "expert_bias", None)
        return None if bias is None else bias[:self.cfg.router_width]

    def record(self, routing: Routing, losses: dict[str, torch.Tensor]) -> None:
        if self.counts_this_forward() and "local_tokens_per_expert" in self._buffers:
            self._add_counts(routing.selected_TE.sum(0, dtype=torch.float32))
        super().record(routing, losses)

    @torch.no_grad()
    def discard_step(self) -> None:
        """Forget this step's counts, Megatron's included."""
        super().discard_step()
        if "local_tokens_per_expert" in self._buffers:
            self.local_tokens_per_expert.zero_()

    def reset_global_aux_loss_tracker(self) -> None:
        """Megatron's once-per-step call under `global_aux_loss`: restart the step's running
        global counts."""
        self.load.reset_global_counts()

    @torch.no_grad()
    def _add_counts(self, counts_E: torch.Tensor) -> None:
        E, buffer = self.cfg.num_experts, self.local_tokens_per_expert
        if buffer.numel() == E:
            buffer += counts_E
        else:
            buffer[:E] += E * counts_E
            buffer[E:] += counts_E.sum()

    @property
    def _padded(self) -> bool:
        bias = getattr(self, "expert_bias", None)
        return bias is not None and bias.numel() > self.cfg.router_width

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._padded:
            destination[prefix + "expert_bias"] = self.bias_E

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "expert_bias"
        if self._padded and key in state_dict:
            padded = torch.zeros_like(self.expert_bias)
            padded[:self.cfg.router_width] = state_dict[key]
            state_dict[key] = padded
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@functools.cache
def megatron_router(router_class: type[Router]) -> type[Router]:
    """`router_class` with Megatron-Core's bias-update contract (one class per router type)."""
    fp32 = tuple(dict.fromkeys((*router_class.fp32_buffers, "local_tokens_per_expert")))
    return type(f"Megatron{router_class.__name__}", (MegatronRouterCounts, router_class),
                {"fp32_buffers": fp32, "__doc__": router_class.__doc__})
