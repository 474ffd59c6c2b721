"""Top-k routing with softmax or sigmoid scores, optionally group-limited.

Group-limited routing follows DeepSeek-V2 (arXiv 2405.04434) / DeepSeek-V3 (arXiv 2412.19437):
a token first picks `groups_per_token` groups by the sum of its best `group_score_topk` scores in
each group (DeepSeek-V3: 2; by default `topk/groups_per_token`, Megatron-Core's rule), then its
top-k experts inside them.
"""
from __future__ import annotations

import torch

from megamoe.registry import ROUTERS
from megamoe.routing.base import Router


def group_limited_mask(scores_TE: torch.Tensor, num_groups: int, groups_per_token: int,
                       experts_per_group_scored: int) -> torch.Tensor:
    """Bool [T, E]: True for experts in each token's best `groups_per_token` groups."""
    T, E = scores_TE.shape
    scores_TGe = scores_TE.view(T, num_groups, E // num_groups)
    group_scores_TG = scores_TGe.topk(experts_per_group_scored, dim=-1).values.sum(-1)
    best_groups_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    best_groups_TG.scatter_(1, group_scores_TG.topk(groups_per_token, dim=-1).indices, True)
    return best_groups_TG.repeat_interleave(E // num_groups, dim=1)


@ROUTERS.register("topk")
class TopKRouter(Router):
    """Each token picks the k experts with the highest (biased) scores.

    Gates are the unbiased scores: softmax over all experts (`pre_softmax`), or renormalised over
    the chosen experts (softmax after selection, and always for sigmoid with k > 1), times
    `topk_scaling_factor`.
    """

    def select(self, scores_TE, logits_TE, real_T=None):
        cfg = self.cfg
        choice_TE = self.selection_scores(scores_TE)
        if cfg.num_groups is not None:
            allowed_TE = group_limited_mask(choice_TE, cfg.num_groups, cfg.groups_per_token,
                                            cfg.experts_scoring_a_group)
            choice_TE = choice_TE.masked_fill(~allowed_TE, float("-inf"))
        topk_idx_TK = choice_TE.topk(cfg.topk, dim=-1).indices
        selected_TE = torch.zeros_like(scores_TE, dtype=torch.bool)
        selected_TE.scatter_(1, topk_idx_TK, True)
        gates_TE = scores_TE * selected_TE
        renormalise = (cfg.score_function == "softmax" and not cfg.pre_softmax) or (
            cfg.score_function == "sigmoid" and cfg.topk > 1)
        if renormalise:
            gates_TE = gates_TE / gates_TE.sum(-1, keepdim=True).clamp_min(1e-20)
        if cfg.topk_scaling_factor is not None:
            gates_TE = gates_TE * cfg.topk_scaling_factor
        return selected_TE, gates_TE
