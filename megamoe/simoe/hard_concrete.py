"""Hard-concrete (L0) gates: the structured masks of SIMoE's experts.

Louizos, Welling, Kingma, "Learning Sparse Neural Networks through L0 Regularization"
(arXiv 1712.01312), with the constants SMAT and SIMoE use: beta = 2/3, zeta = 1.1, gamma = -0.1.
A gate z = clamp(sigmoid((logit(u) + log_alpha) / beta) * (zeta - gamma) + gamma, 0, 1) with
uniform noise u in training; the gate served is the one at the noise's median u = 1/2,
clamp(sigmoid(log_alpha / beta) * (zeta - gamma) + gamma, 0, 1). SMAT draws u from
U(1/2 - 1e-6, 1/2 + 1e-6), so the gates it trains are the gates it serves (Louizos et al. draw
U(0, 1) and serve sigmoid(log_alpha), a different model), and clips log_alpha to +-log 100.
The expected L0 norm (probability that a gate is non-zero under U(0, 1) noise) is
differentiable in log_alpha: the sparsity penalty.

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
    """(gamma, zeta) stretch of a (0, 1) value, before the clamp to [0, 1]."""
    return s * (ZETA - GAMMA) + GAMMA


def sample_gates(log_alpha_MN: torch.Tensor, noise_MN: torch.Tensor,
                 straight_through: bool = False) -> torch.Tensor:
    """Training-time gates from uniform noise in (0, 1) of the same shape. `straight_through`:
    the clamp to [0, 1] passes its gradient straight through (Bengio, Leonard, Courville,
    arXiv 1308.3432), so a gate held at 0 or 1 still hears the loss; the values are unchanged."""
    u = noise_MN.clamp(_EPS, 1.0 - _EPS)
    stretched_MN = _stretch(torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha_MN) / BETA))
    gates_MN = stretched_MN.clamp(0.0, 1.0)
    if straight_through:
        return gates_MN.detach() + stretched_MN - stretched_MN.detach()
    return gates_MN


def deterministic_gates(log_alpha_MN: torch.Tensor) -> torch.Tensor:
    """The gates served: the training gates at the noise's median u = 1/2."""
    return _stretch(torch.sigmoid(log_alpha_MN / BETA)).clamp(0.0, 1.0)


class _ClipInward(torch.autograd.Function):
    """Clamp to [-bound, bound]; the gradient passes inside, and outside only where a descent
    step moves the value back towards the interval (so the bound is a wall, not a trap)."""

    @staticmethod
    def forward(ctx, x, bound: float):
        ctx.save_for_backward(x)
        ctx.bound = bound
        return x.clamp(-bound, bound)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        outward = ((x > ctx.bound) & (grad < 0)) | ((x < -ctx.bound) & (grad > 0))
        return grad.masked_fill(outward, 0.0), None


def clip_log_alpha(log_alpha: torch.Tensor, bound: float) -> torch.Tensor:
    """log_alpha clipped to +-bound (SMAT clips the parameter to +-log 100 before each step; a
    clip in the forward pass does the same whatever optimizer holds the parameter)."""
    return _ClipInward.apply(log_alpha, bound)


def prob_nonzero(log_alpha_MN: torch.Tensor) -> torch.Tensor:
    """P(z != 0) per gate: the expected L0 contribution of each gated column."""
    return torch.sigmoid(log_alpha_MN - _L0_SHIFT)
