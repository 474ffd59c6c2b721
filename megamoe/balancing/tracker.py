"""Per-router accumulation of one optimizer step's routing statistics.

Everything stays on the device as tensors (no host sync per micro-batch); `megamoe.balancing.
step_balancing` reduces them over the replica group once per step and resets them.
"""
from __future__ import annotations

from typing import Optional

import torch


class LoadTracker:
    """Routing counts of the kept training forwards since the last `reset`.

    selected_E: tokens that chose each expert (the c_i of loss-free balancing).
    routed_E: tokens actually dispatched to each expert (after capacity drops).
    tokens, experts_per_token_sum/min/max: over non-padded tokens.
    max_gate_sum: each token's largest router probability (P normalised per token), summed.
    microbatch_maxvio_sum, microbatches: MaxVio of each micro-batch on this rank.
    loss_sums: detached balance-loss values summed over micro-batches.
    global_counts_E, global_microbatches: the global aux loss's assignment counts over the
        router's replica group, summed over this step's micro-batches (its running mean).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.selected_E: Optional[torch.Tensor] = None
        self.routed_E: Optional[torch.Tensor] = None
        # tokens, experts/token sum, maxvio sum, micro-batches, max-gate sum
        self.sums: Optional[torch.Tensor] = None
        self.experts_per_token_max: Optional[torch.Tensor] = None
        self.experts_per_token_min: Optional[torch.Tensor] = None
        self.loss_sums: dict[str, torch.Tensor] = {}
        self.reset_global_counts()

    def reset_global_counts(self) -> None:
        self.global_counts_E: Optional[torch.Tensor] = None
        self.global_microbatches = 0

    def mean_global_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Add one micro-batch's replica-group counts; return their mean over this step so far
        (Megatron-Core's global aux loss, arXiv 2501.11873)."""
        counts_E = counts_E.detach()
        self.global_counts_E = counts_E if self.global_counts_E is None else \
            self.global_counts_E + counts_E
        self.global_microbatches += 1
        return self.global_counts_E / self.global_microbatches

    @property
    def empty(self) -> bool:
        return self.selected_E is None

    def record(self, selected_TE: torch.Tensor, routing_map_TE: torch.Tensor,
               probs_TE: Optional[torch.Tensor] = None,
               tokens_T: Optional[torch.Tensor] = None) -> None:
        """Add one micro-batch's selection, dispatch map and (optionally) router scores and
        non-padding tokens (default: the tokens routed to at least one expert)."""
        selected_E = selected_TE.sum(0, dtype=torch.float32)
        routed_E = routing_map_TE.sum(0, dtype=torch.float32)
        per_token_T = selected_TE.sum(1)
        real_T = per_token_T > 0 if tokens_T is None else tokens_T
        tokens = real_T.sum(dtype=torch.float32)
        per_token_real = per_token_T[real_T].to(torch.float32)
        max_gate = tokens * 0
        if probs_TE is not None:
            p_TE = probs_TE.detach()[real_T].to(torch.float32)
            max_gate = (p_TE.amax(-1) / p_TE.sum(-1).clamp_min(1e-20)).sum()
        sums = torch.stack([tokens, per_token_real.sum(), maxvio(selected_E),
                            torch.ones((), device=tokens.device), max_gate])
        big = torch.tensor(float(self.num_experts + 1), device=tokens.device)
        ept_max = per_token_real.max() if per_token_real.numel() else big * 0
        ept_min = per_token_real.min() if per_token_real.numel() else big
        if self.empty:
            self.selected_E, self.routed_E, self.sums = selected_E, routed_E, sums
            self.experts_per_token_max, self.experts_per_token_min = ept_max, ept_min
            return
        self.selected_E = self.selected_E + selected_E
        self.routed_E = self.routed_E + routed_E
        self.sums = self.sums + sums
        self.experts_per_token_max = torch.maximum(self.experts_per_token_max, ept_max)
        self.experts_per_token_min = torch.minimum(self.experts_per_token_min, ept_min)

    def record_losses(self, losses: dict[str, torch.Tensor]) -> None:
        for name, value in losses.items():
            value = value.detach().to(torch.float32)
            self.loss_sums[name] = self.loss_sums.get(name, 0) + value


def maxvio(counts_E: torch.Tensor) -> torch.Tensor:
    """MaxVio = (max_i c_i - mean(c)) / mean(c) (Wang et al., arXiv 2408.15664)."""
    mean = counts_E.mean()
    return (counts_E.max() - mean) / mean.clamp_min(1e-9)
