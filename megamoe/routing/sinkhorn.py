"""Sinkhorn routing: balanced optimal transport of tokens to experts (Clark et al., "Unified
Scaling Laws for Routed Language Models", arXiv 2202.01169; Selective Sinkhorn Routing, arXiv
2511.08972).

Training: the plan P = diag(u) exp(Z) diag(v) over all N real tokens of the expert-parallel
group (`megamoe.routing.group`) with row sums 1 and column sums N / E, found by Sinkhorn's
alternating scaling in log space until every column is within `router.tolerance` (relative)
of N / E or `router.max_iterations` is reached. Given the column potentials log v, a token's
plan row is softmax(z + log v): each token takes its top-k experts of that row, and the gates
are those plan entries (differentiable in the token's logits; not renormalised). Inference:
plain top-k of softmax(z), gates the softmax probabilities.

Shape legend: T tokens, N the group's real tokens, E experts, K chosen.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megamoe.config import RouterConfig
from megamoe.errors import ConfigError
from megamoe.registry import ROUTERS
from megamoe.routing.base import Router, refuse_expert_bias
from megamoe.routing.group import gather_group_logits
from megamoe.settings import training_setting


@torch.no_grad()
def sinkhorn_potentials(logits_NE: torch.Tensor, tolerance: float,
                        max_iterations: int) -> torch.Tensor:
    """[E]: log v such that softmax(logits + log v) over experts has column sums N / E."""
    N, E = logits_NE.shape
    logits_NE = logits_NE.to(torch.float64)
    log_v_E = torch.zeros(E, dtype=torch.float64, device=logits_NE.device)
    if N == 0:
        return log_v_E
    target = N / E
    for _ in range(max_iterations):
        columns_E = torch.softmax(logits_NE + log_v_E, dim=-1).sum(0)
        if float((columns_E / target - 1.0).abs().max()) <= tolerance:
            break
        log_v_E = log_v_E + math.log(target) - columns_E.log()
    return log_v_E


def top_k_map(values_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [T, E]: each row's k largest entries."""
    selected_TE = torch.zeros_like(values_TE, dtype=torch.bool)
    selected_TE.scatter_(1, values_TE.detach().topk(k, dim=-1).indices, True)
    return selected_TE


@dataclass
class SinkhornRouterConfig(RouterConfig):
    """The Sinkhorn router's settings (its gates come from the transport plan of exp(logits))."""

    tolerance: float = training_setting(1e-4)
    """Stop when every expert's share of the transport plan is within this relative tolerance
    of 1/E."""

    max_iterations: int = training_setting(100)
    """Cap on the Sinkhorn iterations per forward."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_score_function("softmax", "its gates come from the transport plan of "
                                               "exp(logits)")
        if self.tolerance < 0 or self.max_iterations < 1:
            raise ConfigError(f"router.tolerance={self.tolerance}, router.max_iterations="
                              f"{self.max_iterations}: use >= 0 and >= 1")

    def check_in(self, moe) -> None:
        super().check_in(moe)
        refuse_expert_bias(self, moe)


@ROUTERS.register("sinkhorn", config=SinkhornRouterConfig)
class SinkhornRouter(Router):
    """Top-k of the Sinkhorn transport plan in training, of the softmax at inference."""

    def select(self, scores_TE, logits_TE, real_T=None):
        cfg = self.cfg
        if not self.training:
            selected_TE = top_k_map(scores_TE, cfg.topk)
            return selected_TE, scores_TE * selected_TE
        group_NE, _ = gather_group_logits(self.group_comm, logits_TE, real_T)
        log_v_E = sinkhorn_potentials(group_NE, cfg.router.tolerance,
                                      cfg.router.max_iterations)
        plan_TE = torch.softmax(logits_TE + log_v_E.to(logits_TE.dtype), dim=-1)
        selected_TE = top_k_map(plan_TE, cfg.topk)
        return selected_TE, plan_TE * selected_TE
