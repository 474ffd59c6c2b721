"""The prompt router of SIMoE and the per-sequence merging coefficients it hands to every layer.

SIMoE (arXiv 2506.12597) merges its experts in parameter space, once per sequence, with
coefficients a_BM read from the prompt; there is no token dispatch. The router follows its
predecessor SMAT (Chen, Wei, Schwarz, ICML 2024): each expert has a key (Kaiming-normal, so
different prompts score differently from the start) and its own score, sigmoid(logit / T) at
inference and a relaxed-Bernoulli sample sigmoid((logit + logistic noise) / T) in training, with
the temperature T annealed linearly (5 to 0.5); the scores are normalised to sum 1. It reads the
mean of the prompt tokens' features (`SIMoEGPTModel.route`: the seed model's final hidden states,
the response unseen, so generation is causal). `MergeState` carries the coefficients from the
model's forward to each interpolated module.

Legend: B sequences, S positions, H hidden, M experts.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
from torch import nn

from megamoe.simoe.config import SIMoEConfig

_EPS = 1.0e-6


class MergeState:
    """Holds the current forward's merging coefficients a_BM; set by the model, read by layers.
    Inside `seed_pass()` the interpolated layers are the frozen seed's."""

    def __init__(self) -> None:
        self.coefficients_BM: Optional[torch.Tensor] = None
        self.router_logits_BM: Optional[torch.Tensor] = None
        """The router's logits behind `coefficients_BM` (None when the coefficients were given)."""
        self.seed_only = False

    def require(self) -> torch.Tensor:
        if self.coefficients_BM is None:
            raise RuntimeError("SIMoE layers ran without merging coefficients: call the model "
                               "through SIMoEGPT.forward, which routes the prompt first")
        return self.coefficients_BM

    @contextlib.contextmanager
    def seed_pass(self) -> Iterator[None]:
        self.seed_only = True
        try:
            yield
        finally:
            self.seed_only = False


def pool_prompt(features_BSH: torch.Tensor, prompt_mask_BS: torch.Tensor) -> torch.Tensor:
    """[B, H]: the mean feature over each sequence's prompt positions."""
    weights_BS = prompt_mask_BS.to(features_BSH.dtype)
    counts_B1 = weights_BS.sum(dim=1, keepdim=True).clamp_min(1.0)
    return torch.einsum("bs,bsh->bh", weights_BS, features_BSH) / counts_B1


class PromptRouter(nn.Module):
    """a_BM = s_BM / sum_m s_BM with s_BM = sigmoid(k_m . f_B / T) (SMAT's selector).

    `weight` [M, H] holds the keys divided by `simoe.router_lr_scale` (the router's own learning
    rate, as for the masks); `updates` counts optimizer steps for the temperature schedule
    (saved with the model, so a resumed run continues it). `simoe.router_anneal_steps` 0 here:
    the end temperature throughout (the trainer resolves 0 to the run's steps)."""

    def __init__(self, hidden_size: int, simoe: SIMoEConfig) -> None:
        super().__init__()
        self.lr_scale = simoe.router_lr_scale
        keys_MH = torch.randn(simoe.num_experts, hidden_size) * math.sqrt(2.0 / hidden_size)
        self.weight = nn.Parameter(keys_MH / self.lr_scale)
        self.start_temperature, self.end_temperature = simoe.router_temperature
        self.anneal_steps = simoe.router_anneal_steps
        self.register_buffer("updates", torch.zeros(1))

    def temperature(self) -> float:
        if self.anneal_steps == 0:
            return self.end_temperature
        done = min(float(self.updates) / self.anneal_steps, 1.0)
        return self.start_temperature + done * (self.end_temperature - self.start_temperature)

    @torch.no_grad()
    def advance(self) -> None:
        """One optimizer step done: the temperature moves on."""
        self.updates += 1

    def logits(self, features_BH: torch.Tensor) -> torch.Tensor:
        """[B, M]: k_m . f_b, the scores' logits before the temperature and the noise (what
        `simoe.router_logit_penalty` penalises)."""
        return features_BH.float() @ (self.weight.float() * self.lr_scale).t()

    def forward(self, features_BH: torch.Tensor, logits_BM: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """a_BM for pooled features f_BH (`logits_BM`: their `logits`, if already computed)."""
        if logits_BM is None:
            logits_BM = self.logits(features_BH)
        if self.training:
            u_BM = torch.rand(logits_BM.shape, device=logits_BM.device).clamp(_EPS, 1.0 - _EPS)
            logits_BM = logits_BM + torch.log(u_BM) - torch.log1p(-u_BM)
        scores_BM = torch.sigmoid(logits_BM / self.temperature())
        return scores_BM / scores_BM.sum(dim=-1, keepdim=True).clamp_min(_EPS)
