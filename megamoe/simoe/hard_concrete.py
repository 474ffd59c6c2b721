"""Hard-concrete (L0) gates: the structured masks of SIMoE's experts.

Louizos, Welling, Kingma, "Learning Sparse Neural Networks through L0 Regularization"
(arXiv 1712.01312), with the constants SMAT and SIMoE use: beta = 2/3, zeta = 1.1, gamma = -0.1.
A gate z = clamp(sigmoid((logit(u) + log_alpha) / beta) * (zeta - gamma) + gamma, 0, 1) with
u ~ U(0, 1) in training; at inference u is replaced by its deterministic limit, so the mask is
fixed. The expected L0 norm (probability that a gate is non-zero) is differentiable in log_alpha.

Legend: M experts, N gated columns (or elements).
"""
from __future__ import annotations

import math

import torch

BETA = 2.0 / 3.0
ZETA = 1.1
GAMMA = -0.1
_EPS = 1.0e-6
_L0_SHIFT = BETA * math.log(-GAMMA / ZETA)


def _stretch(s: torch.Tensor) -> torch.Tensor:
    return (s * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)


def sample_gates(log_alpha_MN: torch.Tensor, noise_MN: torch.Tensor) -> torch.Tensor:
    """Training-time gates from uniform noise in (0, 1) of the same shape."""
    u = noise_MN.clamp(_EPS, 1.0 - _EPS)
    return _stretch(torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha_MN) / BETA))


def deterministic_gates(log_alpha_MN: torch.Tensor) -> torch.Tensor:
    """Inference-time gates: the fixed masks SIMoE merges with."""
    return _stretch(torch.sigmoid(log_alpha_MN))


def prob_nonzero(log_alpha_MN: torch.Tensor) -> torch.Tensor:
    """P(z != 0) per gate: the expected L0 contribution of each gated column."""
    return torch.sigmoid(log_alpha_MN - _L0_SHIFT)
