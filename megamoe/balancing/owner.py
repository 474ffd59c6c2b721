"""Who ends each optimizer step's balancing (the expert-bias update, the expert thresholds, the
adaptive aux-loss coefficient), decided once, when the model is built.

A router's counts of one step must be turned into these updates exactly once. Three training
loops do it differently, and the builder of the model knows which one will run it:
- megamoe's trainer, or a plain PyTorch loop, calls `megamoe.balancing.step_balancing` after
  each step's backward passes (`STEP_BALANCING`);
- Megatron-LM's loop with `moe_router_enable_expert_bias` (or quantile balancing, megatron-core
  0.19) updates every expert bias in Megatron-Core's `finalize_model_grads` (its own rate and
  rule, `megamoe.megatron.router_counts`) and never calls `step_balancing`: the layer applies the
  rest of the step at the next step's first forward (`FINALIZE_MODEL_GRADS`);
- Megatron-LM's loop without that flag updates nothing: the layer applies the whole step,
  the bias included, at the next step's first forward (`NEXT_FORWARD`).
"""
from __future__ import annotations

import enum


class StepOwner(enum.Enum):
    """Who ends a router's step (see the module docstring)."""

    STEP_BALANCING = "step_balancing"
    FINALIZE_MODEL_GRADS = "finalize_model_grads"
    NEXT_FORWARD = "next_forward"

    @property
    def bias_by_step_balancing(self) -> bool:
        """`step_balancing` updates the expert bias (Megatron's finalize_model_grads does not)."""
        return self is not StepOwner.FINALIZE_MODEL_GRADS

    @property
    def step_ends_in_forward(self) -> bool:
        """The layer itself ends the last step at the first forward of the next one (no loop
        calls `step_balancing`)."""
        return self is not StepOwner.STEP_BALANCING
