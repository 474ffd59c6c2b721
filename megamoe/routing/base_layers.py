"""BASE layers: balanced assignment of tokens to experts (Lewis et al. 2021, arXiv 2103.16716).

Training: each of the N real tokens of the expert-parallel group (`megamoe.routing.group`) goes
to exactly one expert, every expert takes N / E of them (the first N mod E experts one more),
and the sum of the chosen logits is maximal: a linear assignment problem, solved as the paper
does by the auction algorithm (Bertsekas), to within N * eps of the optimum (eps = 1e-3 of the
logits' range), warm-started from the previous call's prices. Inference: greedy top-1. The layer's output takes BASE's form
sigmoid(h . w_e) * f_e(h) + (1 - sigmoid(h . w_e)) * h, with h the MoE layer's input; a token
that capacity drops gets h.

Shape legend: T tokens, N the group's real tokens, E experts, D hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megamoe.config import RouterConfig
from megamoe.errors import ConfigError
from megamoe.registry import ROUTERS
from megamoe.routing.base import Router, Routing, refuse_expert_bias
from megamoe.routing.group import gather_group_logits, scatter_rows
from megamoe.settings import model_setting


def expert_slots(num_tokens: int, num_experts: int) -> torch.Tensor:
    """[E]: tokens each expert takes, N // E each and one more for the first N mod E."""
    slots_E = torch.full((num_experts,), num_tokens // num_experts, dtype=torch.long)
    slots_E[:num_tokens % num_experts] += 1
    return slots_E


@torch.no_grad()
def balanced_assignment(logits_NE: torch.Tensor, relative_eps: float = 1e-3,
                        prices_E: Optional[torch.Tensor] = None) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """([N] expert of each token, [E] final prices): an assignment with the loads of
    `expert_slots` whose summed logits are within N * eps of the maximum, eps =
    `relative_eps` * (max - min logit), by Bertsekas' auction algorithm with eps-scaling (as
    BASE layers solve it). `prices_E` (e.g. the previous call's) warm-starts the prices; the
    result is deterministic for the same inputs."""
    N, E = logits_NE.shape
    z_NE = logits_NE.detach().to(torch.float64).cpu()
    slots_E = expert_slots(N, E)
    spread = max(float(z_NE.max() - z_NE.min()), 1e-6) if N else 1e-6
    final_eps = spread * relative_eps
    if prices_E is None:
        prices_E, eps = torch.zeros(E, dtype=torch.float64), spread / 4
    else:
        prices_E, eps = prices_E.to(torch.float64).cpu().clone(), 8 * final_eps
    while True:
        expert_N = _auction(z_NE, slots_E, prices_E, max(eps, final_eps))
        if eps <= final_eps:
            return expert_N.to(logits_NE.device), prices_E
        eps /= 8


def _auction(z_NE: torch.Tensor, slots_E: torch.Tensor, prices_E: torch.Tensor,
             eps: float) -> torch.Tensor:
    """One auction at fixed eps (Jacobi bidding; `prices_E` updated in place): every unassigned
    token bids for its best expert price + (best - second best value) + eps; each expert keeps
    its highest bids up to its slots, and a full expert's price is its lowest kept bid."""
    N, E = z_NE.shape
    expert_N = torch.full((N,), -1, dtype=torch.long)
    bid_N = torch.zeros(N, dtype=torch.float64)
    while True:
        free = (expert_N < 0).nonzero().squeeze(1)
        if free.numel() == 0:
            return expert_N
        top = (z_NE[free] - prices_E).topk(min(2, E), dim=1)
        best = top.indices[:, 0]
        gain = top.values[:, 0] - top.values[:, -1] if E > 1 else torch.zeros_like(best, dtype=
                                                                                   torch.float64)
        held = (expert_N >= 0).nonzero().squeeze(1)
        tokens = torch.cat([held, free])
        experts = torch.cat([expert_N[held], best])
        bids = torch.cat([bid_N[held], prices_E[best] + gain + eps])
        order = bids.argsort(descending=True, stable=True)
        order = order[experts[order].argsort(stable=True)]  # by expert, highest bid first
        group = experts[order]
        counts = torch.bincount(group, minlength=E)
        rank = torch.arange(order.numel()) - (counts.cumsum(0) - counts)[group]
        keep = rank < slots_E[group]
        expert_N[tokens] = -1
        kept_tokens, kept_experts, kept_bids = tokens[order[keep]], group[keep], bids[order[keep]]
        expert_N[kept_tokens], bid_N[kept_tokens] = kept_experts, kept_bids
        full = torch.bincount(kept_experts, minlength=E) == slots_E
        lowest = torch.full((E,), float("inf"), dtype=torch.float64).scatter_reduce(
            0, kept_experts, kept_bids, "amin")
        prices_E[full] = lowest[full]


@dataclass
class BaseRouterConfig(RouterConfig):
    """The BASE-layers router's settings (one expert per token, gates sigmoid(logit))."""

    score_function: str = model_setting("sigmoid")
    """Only `sigmoid`: the router's gates are sigmoid(logit)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_score_function("sigmoid", "its gates are sigmoid(logit)")

    def check_in(self, moe) -> None:
        super().check_in(moe)
        if moe.topk != 1:
            raise ConfigError(f"topk={moe.topk} with router.kind='base': BASE layers send each "
                              "token to one expert; set topk=1")
        refuse_expert_bias(self, moe)


@ROUTERS.register("base", config=BaseRouterConfig)
class BaseLayersRouter(Router):
    """Balanced linear assignment in training, greedy top-1 at inference; sigmoid gates."""

    def __init__(self, cfg, init_method=None):
        super().__init__(cfg, init_method)
        self._prices_E: Optional[torch.Tensor] = None  # the last auction's prices (warm start)

    def select(self, scores_TE, logits_TE, real_T=None):
        if self.training:
            group_NE, own = gather_group_logits(self.group_comm, logits_TE, real_T)
            expert_N, self._prices_E = balanced_assignment(group_NE, prices_E=self._prices_E)
            expert_T = scatter_rows(expert_N[own], real_T, 0)
        else:
            expert_T = logits_TE.detach().argmax(-1)
        selected_TE = torch.zeros_like(logits_TE, dtype=torch.bool)
        selected_TE.scatter_(1, expert_T.unsqueeze(1), True)
        if real_T is not None:
            selected_TE &= real_T.unsqueeze(1)
        return selected_TE, scores_TE * selected_TE

    def mix_output(self, x_TD: torch.Tensor, y_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """sigma * f_e(h) + (1 - sigma) * h: `y_TD` already holds sigma * f_e(h); tokens routed
        to no expert by capacity keep h, padding tokens get 0."""
        chosen_T = routing.selected_TE.any(-1, keepdim=True)
        keep_T1 = (1.0 - routing.gates_TE.sum(-1, keepdim=True)) * chosen_T
        return y_TD + keep_T1.to(x_TD.dtype) * x_TD
