"""Routing at inference: how many experts each token gets in eval mode, token by token.

Training counts (`LoadTracker`) cover kept training forwards only. Routers whose inference
routing differs from their training routing (dynamic top-p's count per token, frozen expert
thresholds, plain top-k for Sinkhorn) are measured here: inside `tallying_inference_routing`,
every eval-mode forward of a megamoe MoE layer records each token's number of selected experts
as a [B, S] tensor, in forward order, so a caller that ran the forwards can pair them with its
own per-token losses ("harder tokens get more experts", Huang et al., arXiv 2403.07652).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Union

import torch
from torch import nn

from megamoe.balancing.balancer import routers_of


class InferenceTally:
    """The experts per token of one router's eval-mode forwards, one [B, S] tensor each."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.counts_BS: list[torch.Tensor] = []

    def record(self, selected_TE: torch.Tensor, S: int, B: int) -> None:
        """Add one forward's selection (tokens in Megatron's [S, B] order, flattened)."""
        self.counts_BS.append(selected_TE.sum(1, dtype=torch.float32).view(S, B).t())


@contextmanager
def tallying_inference_routing(models: Union[nn.Module, list[nn.Module]]
                               ) -> Iterator[dict[int, InferenceTally]]:
    """Within the block, every router of `models` tallies its eval-mode forwards; yields
    {layer number (or index when unnumbered): tally}."""
    routers = routers_of(models)
    tallies = {}
    for index, router in enumerate(routers):
        router.inference_tally = InferenceTally(router.cfg.num_experts)
        tallies[router.layer_number if router.layer_number is not None else index] = \
            router.inference_tally
    try:
        yield tallies
    finally:
        for router in routers:
            router.inference_tally = None
