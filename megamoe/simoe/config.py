"""SIMoEConfig: the knobs of Sparse Interpolated Mixture-of-Experts, validated in one place.

Where the SIMoE paper (Chen, Wei, Schwarz, ACL 2025, arXiv 2506.12597) does not state a detail,
the default follows its predecessor SMAT (Chen et al., ICML 2024), as `../shared/research-notes.md`
records; each such field says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from megamoe.errors import ConfigError


@dataclass
class SIMoEConfig:
    num_experts: int = 8
    """M: structured masks over the one shared delta (SIMoE uses 8)."""

    target_sparsity: float = 0.75
    """Fraction of the delta each expert should mask out (SIMoE: 75%); 0 keeps every column."""

    log_alpha_init_std: float = 0.5
    """Hard-concrete gates start at log-alpha ~ N(0, std) (SMAT's init; not confirmed for SIMoE)."""

    mask_lr_scale: float = 50.0
    """The masks learn this many times faster than the delta (SMAT, like CoFi, gives the mask
    parameters their own larger learning rate; here one schedule serves both: the gates' log-alpha
    is stored divided by this factor, and Adam's step is invariant to that scale)."""

    lagrangian_lr: float = 0.1
    """Step size of the dual ascent on each expert's sparsity multiplier (SMAT's one-sided
    Lagrangian; the step size is not published, ours is sized for a loss of order 1)."""

    orthogonality_coefficient: float = 1.0e-2
    """Weight of the pairwise mask-overlap penalty (SIMoE's "where to upcycle" term)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"simoe.num_experts={self.num_experts} must be at least 1")
        if not 0.0 <= self.target_sparsity < 1.0:
            raise ConfigError(f"simoe.target_sparsity={self.target_sparsity} must be in [0, 1), "
                              "the fraction of each expert's delta that is masked out")
        if self.mask_lr_scale <= 0:
            raise ConfigError(f"simoe.mask_lr_scale={self.mask_lr_scale} must be > 0")
        for name in ("log_alpha_init_std", "lagrangian_lr", "orthogonality_coefficient"):
            if getattr(self, name) < 0:
                raise ConfigError(f"simoe.{name}={getattr(self, name)} must be >= 0")
