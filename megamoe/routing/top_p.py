"""Dynamic top-p routing ("Harder Tasks Need More Experts: Dynamic Routing in MoE Models",
Huang et al., ACL 2024, arXiv 2403.07652).

Each token takes the smallest set of experts, in order of decreasing probability, whose summed
probability reaches p; the expert that crosses p is included and at least one expert is always
chosen. Gates are the raw softmax probabilities (not renormalised). With loss-free balancing the
bias reorders the experts; the mass that is summed is always the unbiased probability.
"""
from __future__ import annotations

import torch

from megamoe.registry import ROUTERS
from megamoe.routing.base import Router


@ROUTERS.register("top_p")
class TopPRouter(Router):
    """Dynamic top-p router: a variable number of experts per token."""

    def select(self, scores_TE, logits_TE, real_T=None):
        order_TE = self.selection_scores(scores_TE).argsort(dim=-1, descending=True)
        sorted_probs_TE = scores_TE.detach().gather(1, order_TE)
        mass_before_TE = sorted_probs_TE.cumsum(-1) - sorted_probs_TE
        take_sorted_TE = mass_before_TE < self.cfg.top_p_threshold
        take_sorted_TE[:, 0] = True
        selected_TE = torch.zeros_like(take_sorted_TE)
        selected_TE.scatter_(1, order_TE, take_sorted_TE)
        return selected_TE, scores_TE * selected_TE
