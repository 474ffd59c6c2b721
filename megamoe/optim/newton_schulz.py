"""The Newton-Schulz orthogonalisation of Muon (Jordan et al. 2024, "Muon: An optimizer for hidden
layers in neural networks", kellerjordan.github.io/posts/muon).

For a matrix G = U S Vᵀ the iteration X <- a X + b (X Xᵀ) X + c (X Xᵀ)² X, started from
G / ||G||_F (so every singular value is at most 1), applies the odd quintic
p(s) = a s + b s³ + c s⁵ to every singular value and leaves U and V alone: after a few steps
X ≈ U Vᵀ, the orthogonal factor of G. Jordan's coefficients (3.4445, -4.7750, 2.0315) make p
steep at 0 rather than exact at 1: five steps take every singular value into roughly [0.7, 1.2],
which is what the update needs (the nearest orthogonal matrix's direction, not its exact value).
The iteration is applied to the wide orientation (rows <= columns; a tall matrix is transposed),
so X Xᵀ is the smaller Gram matrix.
"""
from __future__ import annotations

import math

import torch

from megamoe.errors import ConfigError

JORDAN_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of Jordan et al.'s quintic, tuned for five steps."""
DEFAULT_STEPS = 5
MAX_STEPS = 100  # the iteration has long converged; each step is three matmuls per matrix
NORM_EPS = 1e-7


def check_newton_schulz(steps: int, coefficients: tuple[float, float, float],
                        where: str = "optimizer.muon") -> None:
    """Refuse settings the iteration cannot run with, in one line."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ConfigError(f"{where}.ns_steps={steps!r} must be an integer from 1 to {MAX_STEPS} "
                          f"(Jordan et al. use {DEFAULT_STEPS}; more steps change nothing but "
                          "the time each optimizer step takes)")
    if len(coefficients) != 3 or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
            for c in coefficients):
        raise ConfigError(f"{where}.ns_coefficients={list(coefficients)!r} must be three finite "
                          f"numbers (a, b, c); Jordan et al.'s are {list(JORDAN_COEFFICIENTS)}")


def newton_schulz(g: torch.Tensor, steps: int = DEFAULT_STEPS,
                  coefficients: tuple[float, float, float] = JORDAN_COEFFICIENTS
                  ) -> torch.Tensor:
    """The approximate orthogonal factor U Vᵀ of every matrix in `g` ([..., rows, cols]: the
    leading dimensions are a batch of independent matrices, e.g. one per expert), computed in
    fp32 by `steps` quintic Newton-Schulz iterations; returned in fp32, same shape."""
    a, b, c = coefficients
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + NORM_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x
