"""Top-k routing with softmax, sigmoid or sqrtsoftplus scores, optionally group-limited.

Group-limited routing follows DeepSeek-V2 (arXiv 2405.04434) / DeepSeek-V3 (arXiv 2412.19437):
a token first picks `groups_per_token` groups by the sum of its best `group_score_topk` scores in
each group (DeepSeek-V3: 2; by default `topk/groups_per_token`, Megatron-Core's rule), then its
top-k experts inside them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megamoe.balancing.quantile import expert_quantile, quantile_routing
from megamoe.config import RouterConfig
from megamoe.errors import ConfigError
from megamoe.registry import ROUTERS
from megamoe.routing.base import Router, in_recomputation
from megamoe.routing.group import gather_group_logits
from megamoe.routing.replay import replayed_topk
from megamoe.settings import model_setting


@dataclass
class TopKRouterConfig(RouterConfig):
    """The top-k router's settings: group-limited routing on top of the common ones."""

    num_groups: Optional[int] = model_setting(None)
    """Group-limited routing (DeepSeek-V2/V3): split the experts into this many equal groups
    (devices or nodes). None disables it."""

    groups_per_token: Optional[int] = model_setting(None)
    """Group-limited routing: how many groups a token may pick its experts from."""

    group_score_topk: Optional[int] = model_setting(None)
    """Group-limited routing: a group's score is the sum of its this-many best (biased) expert
    scores (DeepSeek-V3: 2, whatever its top-k). None takes Megatron-Core's rule, topk /
    groups_per_token, which needs topk to be a multiple of groups_per_token."""

    takes_quantile_balancing = True
    takes_replay = True
    takes_zero_experts = True

    def check_in(self, moe) -> None:
        """The groups split the layer's experts and hold at least top-k of them; quantile
        balancing routes without groups and leaves an expert out of each token's top-k."""
        if moe.balancing.uses_quantile and (self.num_groups is not None
                                            or moe.topk >= moe.num_experts):
            raise ConfigError(
                f"balancing.methods=quantile with router.num_groups={self.num_groups}, topk="
                f"{moe.topk} of {moe.num_experts} experts: quantile balancing takes no group-"
                "limited routing (Megatron-Core's rule) and needs topk < num_experts; unset "
                "router.num_groups / router.groups_per_token or lower topk")
        if self.num_groups is not None and moe.experts.zero_experts:
            raise ConfigError(f"router.num_groups={self.num_groups} with experts.zero_experts="
                              f"{moe.experts.zero_experts}: group-limited routing splits real "
                              "experts only; unset router.num_groups / router.groups_per_token")
        if (self.num_groups is None) != (self.groups_per_token is None):
            raise ConfigError(f"router.num_groups={self.num_groups}, router.groups_per_token="
                              f"{self.groups_per_token}: group-limited routing needs both set "
                              "(or both None)")
        if self.num_groups is None:
            return
        if self.num_groups <= 0 or moe.num_experts % self.num_groups:
            raise ConfigError(f"router.num_groups={self.num_groups} does not divide num_experts="
                              f"{moe.num_experts}; pick a divisor of num_experts")
        if not 0 < self.groups_per_token <= self.num_groups:
            raise ConfigError(f"router.groups_per_token={self.groups_per_token} must be in "
                              f"1..router.num_groups={self.num_groups}")
        if self.group_score_topk is None and moe.topk % self.groups_per_token:
            raise ConfigError(
                f"topk={moe.topk} is not a multiple of router.groups_per_token="
                f"{self.groups_per_token}; a group is scored by its best topk/groups_per_token "
                "experts unless router.group_score_topk says how many")
        experts_per_group = moe.num_experts // self.num_groups
        if self.group_score_topk is not None and not (
                0 < self.group_score_topk <= experts_per_group):
            raise ConfigError(f"router.group_score_topk={self.group_score_topk} must be in "
                              f"1..{experts_per_group} (the experts of one group)")
        experts_in_chosen_groups = self.groups_per_token * experts_per_group
        if moe.topk > experts_in_chosen_groups:
            raise ConfigError(f"topk={moe.topk} exceeds the {experts_in_chosen_groups} experts in "
                              f"router.groups_per_token={self.groups_per_token} groups; raise "
                              "router.groups_per_token")

    def experts_scoring_a_group(self, topk: int) -> int:
        """How many of a group's best expert scores add up to its score (`group_score_topk`,
        else topk / groups_per_token)."""
        return self.group_score_topk or topk // self.groups_per_token


def group_limited_mask(scores_TE: torch.Tensor, num_groups: int, groups_per_token: int,
                       experts_per_group_scored: int) -> torch.Tensor:
    """Bool [T, E]: True for experts in each token's best `groups_per_token` groups."""
    T, E = scores_TE.shape
    scores_TGe = scores_TE.view(T, num_groups, E // num_groups)
    group_scores_TG = scores_TGe.topk(experts_per_group_scored, dim=-1).values.sum(-1)
    best_groups_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    best_groups_TG.scatter_(1, group_scores_TG.topk(groups_per_token, dim=-1).indices, True)
    return best_groups_TG.repeat_interleave(E // num_groups, dim=1)


@ROUTERS.register("topk", config=TopKRouterConfig)
class TopKRouter(Router):
    """Each token picks the k experts with the highest (biased) scores.

    Under quantile balancing (`megamoe.balancing.quantile`) the experts are the top k of the
    fp32 logits minus its bias instead. With `router.replay` the experts may be replayed
    (`megamoe.routing.replay`).
    Gates are the unbiased scores: softmax over all experts (`pre_softmax`), or renormalised over
    the chosen experts (softmax after selection, and always for sigmoid and sqrtsoftplus with
    k > 1), times `topk_scaling_factor`.
    """

    def select(self, scores_TE, logits_TE, real_T=None):
        cfg, topk = self.cfg.router, self.cfg.topk
        if self.quantile_beta_E is not None:
            topk_idx_TK = self.quantile_choice(logits_TE, real_T)
        else:
            choice_TE = self.selection_scores(scores_TE)
            if cfg.num_groups is not None:
                allowed_TE = group_limited_mask(choice_TE, cfg.num_groups, cfg.groups_per_token,
                                                cfg.experts_scoring_a_group(topk))
                choice_TE = choice_TE.masked_fill(~allowed_TE, float("-inf"))
            topk_idx_TK = choice_TE.topk(topk, dim=-1).indices
        if self.replay is not None:
            topk_idx_TK = replayed_topk(self.replay, topk_idx_TK, scores_TE.shape[1],
                                        in_recomputation())
        selected_TE = torch.zeros_like(scores_TE, dtype=torch.bool)
        selected_TE.scatter_(1, topk_idx_TK, True)
        gates_TE = scores_TE * selected_TE
        renormalise = (cfg.score_function == "softmax" and not cfg.pre_softmax) or (
            cfg.score_function != "softmax" and topk > 1)
        if renormalise:
            gates_TE = gates_TE / gates_TE.sum(-1, keepdim=True).clamp_min(1e-20)
        if cfg.topk_scaling_factor is not None:
            gates_TE = gates_TE * cfg.topk_scaling_factor
        return selected_TE, gates_TE

    @torch.no_grad()
    def quantile_choice(self, logits_TE: torch.Tensor,
                        real_T: Optional[torch.Tensor]) -> torch.Tensor:
        """Quantile balancing's top-k [T, K]; a counted forward also estimates the next bias
        from the real tokens of the whole token group (the tensor-parallel ranks')."""
        logits_TE = logits_TE.detach().float()
        topk_idx_TK, cutoff_T1 = quantile_routing(logits_TE, self.quantile_beta_E, self.cfg.topk)
        if self.counts_this_forward():
            shifted_NE, _ = gather_group_logits(self.token_comm, logits_TE - cutoff_T1, real_T)
            if shifted_NE.shape[0]:
                self.add_quantile_estimate(expert_quantile(shifted_NE, self.cfg.topk))
        return topk_idx_TK
