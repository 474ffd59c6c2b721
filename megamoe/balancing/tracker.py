"""Per-router accumulation of one optimizer step's routing statistics.

Everything stays on the device as tensors (no host sync per micro-batch); `megamoe.balancing.
step_balancing` reduces them over the replica group once per step (`StepStatistics.pack` /
`unpack`) and resets them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

_SUMMED = ("tokens", "experts_per_token_sum", "maxvio_sum", "microbatches", "max_gate_sum")


@dataclass
class StepStatistics:
    """One router's routing statistics over kept training forwards (scalars are 0-d tensors).

    selected_E: tokens that chose each expert (the c_i of loss-free balancing).
    routed_E: tokens actually dispatched to each expert (after capacity drops).
    tokens: non-padded tokens.
    experts_per_token_sum / _max / _min: experts of each non-padded token, summed / extremes.
    maxvio_sum, microbatches: MaxVio of each micro-batch, summed, and the micro-batches.
    max_gate_sum: each token's largest router probability (P normalised per token), summed.
    losses: detached balance-loss values summed over micro-batches, by name.
    """

    selected_E: torch.Tensor
    routed_E: torch.Tensor
    tokens: torch.Tensor
    experts_per_token_sum: torch.Tensor
    maxvio_sum: torch.Tensor
    microbatches: torch.Tensor
    max_gate_sum: torch.Tensor
    experts_per_token_max: torch.Tensor
    experts_per_token_min: torch.Tensor
    losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def none(cls, num_experts: int, device: torch.device) -> "StepStatistics":
        """The statistics of no tokens (the extremes at values every real count replaces)."""
        zero = torch.zeros((), device=device)
        return cls(torch.zeros(num_experts, device=device), torch.zeros(num_experts, device=device),
                   *([zero] * len(_SUMMED)), experts_per_token_max=zero,
                   experts_per_token_min=zero + num_experts + 1)

    def plus(self, other: "StepStatistics") -> "StepStatistics":
        """The statistics of both sets of forwards."""
        summed = {name: getattr(self, name) + getattr(other, name)
                  for name in ("selected_E", "routed_E", *_SUMMED)}
        losses = dict(self.losses)
        for name, value in other.losses.items():
            losses[name] = losses[name] + value if name in losses else value
        return StepStatistics(
            **summed, losses=losses,
            experts_per_token_max=torch.maximum(self.experts_per_token_max,
                                                other.experts_per_token_max),
            experts_per_token_min=torch.minimum(self.experts_per_token_min,
                                                other.experts_per_token_min))

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values to all-reduce by SUM, values to all-reduce by MAX): [selected_E, routed_E,
        the summed scalars, losses by sorted name] and [max, -min experts per token]."""
        sums = torch.cat([self.selected_E, self.routed_E,
                          torch.stack([getattr(self, name) for name in _SUMMED]),
                          *(self.losses[name].reshape(1) for name in sorted(self.losses))])
        maxes = torch.stack([self.experts_per_token_max, -self.experts_per_token_min])
        return sums, maxes

    @classmethod
    def unpack(cls, sums: torch.Tensor, maxes: torch.Tensor, num_experts: int,
               loss_names: list[str]) -> "StepStatistics":
        """The statistics `pack` gave (`sums` and `maxes` possibly all-reduced); `loss_names`
        those of the packed statistics."""
        E = num_experts
        scalars = sums[2 * E:2 * E + len(_SUMMED)]
        losses = sums[2 * E + len(_SUMMED):]
        return cls(sums[:E], sums[E:2 * E], *scalars.unbind(),
                   experts_per_token_max=maxes[0], experts_per_token_min=-maxes[1],
                   losses=dict(zip(sorted(loss_names), losses.unbind())))


class LoadTracker:
    """Routing statistics of the kept training forwards since the last `reset` (`stats`, None
    before the first), and the global aux loss's running counts.

    global_counts_E, global_microbatches: the global aux loss's assignment counts over the
        router's replica group, summed over this step's micro-batches (its running mean).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.stats: Optional[StepStatistics] = None
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
        return self.stats is None

    def record(self, selected_TE: torch.Tensor, routing_map_TE: torch.Tensor,
               probs_TE: Optional[torch.Tensor] = None,
               tokens_T: Optional[torch.Tensor] = None,
               losses: Optional[dict[str, torch.Tensor]] = None) -> None:
        """Add one micro-batch's selection, dispatch map and (optionally) router scores,
        non-padding tokens (default: the tokens routed to at least one expert) and balance-loss
        values."""
        selected_E = selected_TE.sum(0, dtype=torch.float32)
        per_token_T = selected_TE.sum(1)
        real_T = per_token_T > 0 if tokens_T is None else tokens_T
        tokens = real_T.sum(dtype=torch.float32)
        per_token_real = per_token_T[real_T].to(torch.float32)
        max_gate = tokens * 0
        if probs_TE is not None:
            p_TE = probs_TE.detach()[real_T].to(torch.float32)
            max_gate = (p_TE.amax(-1) / p_TE.sum(-1).clamp_min(1e-20)).sum()
        if per_token_real.numel():
            most, least = per_token_real.max(), per_token_real.min()
        else:  # no real token: the extremes of no tokens
            none = StepStatistics.none(self.num_experts, tokens.device)
            most, least = none.experts_per_token_max, none.experts_per_token_min
        micro = StepStatistics(
            selected_E, routing_map_TE.sum(0, dtype=torch.float32), tokens,
            per_token_real.sum(), maxvio(selected_E), torch.ones((), device=tokens.device),
            max_gate, most, least,
            {name: value.detach().to(torch.float32) for name, value in (losses or {}).items()})
        self.stats = micro if self.stats is None else self.stats.plus(micro)


def maxvio(counts_E: torch.Tensor) -> torch.Tensor:
    """MaxVio = (max_i c_i - mean(c)) / mean(c) (Wang et al., arXiv 2408.15664)."""
    mean = counts_E.mean()
    return (counts_E.max() - mean) / mean.clamp_min(1e-9)
