"""Dynamic top-p routing ("Harder Tasks Need More Experts: Dynamic Routing in MoE Models",
Huang et al., ACL 2024, arXiv 2403.07652).

Each token takes the smallest set of experts, in order of decreasing probability, whose summed
probability reaches p; the expert that crosses p is included and at least one expert is always
chosen. Gates are the raw softmax probabilities (not renormalised). With loss-free balancing the
bias reorders the experts; the mass that is summed is always the unbiased probability.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.balancing.losses import entropy_loss
from megamoe.config import RouterConfig
from megamoe.errors import ConfigError
from megamoe.registry import ROUTERS
from megamoe.routing.base import Router, Routing
from megamoe.settings import model_setting, training_setting


@dataclass
class TopPRouterConfig(RouterConfig):
    """The top-p router's settings."""

    threshold: float = model_setting(0.4)
    """p: each token takes the smallest set of experts whose probability mass reaches p."""

    entropy_loss_coeff: float = training_setting(1e-4)
    """Weight of the entropy ("dynamic") loss that keeps the distribution from flattening."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"router.threshold={self.threshold} is outside (0, 1]; pick e.g. "
                              "0.4")
        if not self.entropy_loss_coeff >= 0:
            raise ConfigError(f"router.entropy_loss_coeff={self.entropy_loss_coeff} is "
                              "negative; use a value >= 0")
        self.require_score_function("softmax", "top-p needs a probability distribution")


@ROUTERS.register("top_p", config=TopPRouterConfig)
class TopPRouter(Router):
    """Dynamic top-p router: a variable number of experts per token."""

    def select(self, scores_TE, logits_TE, real_T=None):
        order_TE = self.selection_scores(scores_TE).argsort(dim=-1, descending=True)
        sorted_probs_TE = scores_TE.detach().gather(1, order_TE)
        mass_before_TE = sorted_probs_TE.cumsum(-1) - sorted_probs_TE
        take_sorted_TE = mass_before_TE < self.cfg.router.threshold
        take_sorted_TE[:, 0] = True
        selected_TE = torch.zeros_like(take_sorted_TE)
        selected_TE.scatter_(1, order_TE, take_sorted_TE)
        return selected_TE, scores_TE * selected_TE

    def loss_coeffs(self) -> dict[str, float]:
        coeff = self.cfg.router.entropy_loss_coeff
        return {"entropy_loss": coeff} if coeff > 0 else {}

    def own_losses(self, routing: Routing, num_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The entropy loss of the token distributions (`megamoe.balancing.losses`)."""
        if not self.loss_coeffs():
            return {}
        return {"entropy_loss": entropy_loss(routing.probs_TE, routing.selected_TE, num_tokens)}
