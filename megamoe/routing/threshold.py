"""Expert-threshold (ET) routing (Sun et al. 2026, arXiv 2603.11535).

Each expert i keeps a threshold c_i, an exponential moving average of the k-th largest router
logit expert i saw in each training batch, k = ceil(N * topk / E) for N tokens (with topk = 1
the paper's k = N / E, an estimate of the (1 - 1/E) quantile of the expert's logits). A token
goes to every expert whose logit clears its threshold, so tokens take a variable number of
experts, possibly none (pair the router with a shared expert, which every token always gets).
Gates are sigmoid(logit), not renormalised.

Training: the micro-batch cutoffs of one optimizer step are averaged over the micro-batches and
over every replica of the router (the same step hook and replica group as the loss-free bias,
`megamoe.balancing.step_balancing`), then c <- beta * c + (1 - beta) * cutoff, bias-corrected
like Adam (c / (1 - beta^t) after t updates). For the first `router.warmup_steps` steps
routing is plain expert choice (each expert takes its k best tokens of the micro-batch). After
that each expert takes between (1 - C) k and (1 + C) k of a micro-batch's tokens
(`router.capacity` C): excess tokens with the lowest logits are dropped, a shortfall is
filled with the next-best tokens. Inference uses the frozen thresholds alone, so a token's
routing never depends on other tokens (causal). The EMA and its update count are fp32 buffers:
they are saved in checkpoints and replicated over every rank like the expert bias.

Shape legend: T tokens, E experts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megamoe.config import RouterConfig
from megamoe.errors import ConfigError
from megamoe.registry import ROUTERS
from megamoe.routing.base import Router, refuse_expert_bias
from megamoe.settings import model_setting, training_setting


@dataclass
class ThresholdRouterConfig(RouterConfig):
    """The expert-threshold router's settings (its gates are sigmoid(logit))."""

    score_function: str = model_setting("sigmoid")
    """Only `sigmoid`: the router's gates are sigmoid(logit)."""

    ema_decay: float = training_setting(0.99)
    """beta of the per-expert threshold EMA (the public code's 0.99; the paper uses 0.999 for
    long runs)."""

    warmup_steps: int = training_setting(100)
    """Optimizer steps of plain expert-choice routing before the thresholds take over (the
    paper warms up for about 4k steps of a long run)."""

    capacity: Optional[float] = training_setting(0.5)
    """Training only: each expert takes between (1 - C) and (1 + C) times its mean share
    N * topk / E of a micro-batch's N tokens (excess dropped by logit, shortfall filled with the
    next-best tokens). None: no bounds."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_score_function("sigmoid", "its gates are sigmoid(logit)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"router.ema_decay={self.ema_decay} is outside [0, 1); use e.g. "
                              "0.99")
        if self.capacity is not None and not 0.0 <= self.capacity < 1.0:
            raise ConfigError(f"router.capacity={self.capacity} is outside [0, 1); use e.g. 0.5, "
                              "or None for no bounds")
        if self.warmup_steps < 0:
            raise ConfigError(f"router.warmup_steps={self.warmup_steps} must be >= 0")

    def check_in(self, moe) -> None:
        super().check_in(moe)
        refuse_expert_bias(self, moe)


def kth_largest(logits_TE: torch.Tensor, k: int, real_T: torch.Tensor) -> torch.Tensor:
    """[E]: each expert's k-th largest logit over the real tokens."""
    masked_TE = logits_TE.masked_fill(~real_T.unsqueeze(1), float("-inf"))
    return masked_TE.topk(k, dim=0).values[-1]


def column_ranks(logits_TE: torch.Tensor, real_T: torch.Tensor) -> torch.Tensor:
    """[T, E]: each token's rank (0 = highest logit) in each expert's column; padding last."""
    masked_TE = logits_TE.masked_fill(~real_T.unsqueeze(1), float("-inf"))
    order_TE = masked_TE.argsort(dim=0, descending=True, stable=True)
    ranks_TE = torch.empty_like(order_TE)
    ranks_TE.scatter_(0, order_TE, torch.arange(order_TE.shape[0], device=order_TE.device)
                      .unsqueeze(1).expand_as(order_TE))
    return ranks_TE


@ROUTERS.register("threshold", config=ThresholdRouterConfig)
class ThresholdRouter(Router):
    """Expert-threshold router: token t goes to expert i iff logit r_ti >= c_i."""

    fp32_buffers = Router.fp32_buffers + ("threshold_ema", "threshold_updates")
    has_step_state = True

    def __init__(self, cfg, init_method=None):
        super().__init__(cfg, init_method)
        self.register_buffer("threshold_ema", torch.zeros(cfg.num_experts))
        self.register_buffer("threshold_updates", torch.zeros(1))
        self._cutoffs: Optional[torch.Tensor] = None  # [E + 1]: summed cutoffs, micro-batches

    @property
    def thresholds_E(self) -> torch.Tensor:
        """The bias-corrected thresholds c / (1 - beta^t) (meaningful once t >= 1)."""
        beta = self.cfg.router.ema_decay
        correction = 1.0 - beta ** self.threshold_updates.clamp_min(1.0)
        return self.threshold_ema / correction

    def expert_share(self, num_tokens: int) -> int:
        """k = ceil(N * topk / E): each expert's mean number of tokens."""
        return max(1, math.ceil(num_tokens * self.cfg.topk / self.cfg.num_experts))

    def select(self, scores_TE, logits_TE, real_T=None):
        logits_TE = logits_TE.detach().to(torch.float32)
        if real_T is None:
            real_T = torch.ones(logits_TE.shape[0], dtype=torch.bool, device=logits_TE.device)
        num_real = int(real_T.sum())
        if num_real == 0:
            return torch.zeros_like(logits_TE, dtype=torch.bool), scores_TE * 0
        k = self.expert_share(num_real)
        if self.counts_this_forward():
            self._add_cutoffs(kth_largest(logits_TE, k, real_T))
        warming_up = self.threshold_updates.item() < max(self.cfg.router.warmup_steps, 1)
        if self.training and warming_up or not self.training and self.threshold_updates.item() == 0:
            selected_TE = column_ranks(logits_TE, real_T) < k  # expert choice
        else:
            selected_TE = logits_TE >= self.thresholds_E
            if self.training and self.cfg.router.capacity is not None:
                selected_TE = self.bounded(selected_TE, logits_TE, real_T, k)
        selected_TE = selected_TE & real_T.unsqueeze(1)
        return selected_TE, scores_TE * selected_TE

    def bounded(self, selected_TE, logits_TE, real_T, k: int) -> torch.Tensor:
        """Training capacity bounds: each expert keeps its best floor((1 + C) k) tokens at most
        and takes its best ceil((1 - C) k) tokens at least."""
        C = self.cfg.router.capacity
        ranks_TE = column_ranks(logits_TE, real_T)
        upper, lower = math.floor((1.0 + C) * k), math.ceil((1.0 - C) * k)
        return (selected_TE & (ranks_TE < upper)) | (ranks_TE < lower)

    def _add_cutoffs(self, cutoff_E: torch.Tensor) -> None:
        one = torch.ones(1, device=cutoff_E.device)
        entry = torch.cat([cutoff_E, one])
        self._cutoffs = entry if self._cutoffs is None else self._cutoffs + entry

    def discard_step(self) -> None:
        super().discard_step()
        self._cutoffs = None

    def step_sums(self) -> torch.Tensor:
        """This rank's summed micro-batch cutoffs and their count (zeros if none)."""
        if self._cutoffs is None:
            return torch.zeros(self.cfg.num_experts + 1, device=self.threshold_ema.device)
        return self._cutoffs

    @torch.no_grad()
    def end_step(self, summed: Optional[torch.Tensor]) -> None:
        """One EMA update from the mean cutoff over micro-batches and replicas."""
        self._cutoffs = None
        if summed is None or float(summed[-1]) == 0:
            return
        beta = self.cfg.router.ema_decay
        mean_E = summed[:-1] / summed[-1]
        self.threshold_ema.mul_(beta).add_((1.0 - beta) * mean_E)
        self.threshold_updates += 1
