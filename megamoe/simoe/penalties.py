"""SIMoE's mask regularisers: expected-L0 sparsity with a one-sided Lagrangian, and mask overlap.

SIMoE (arXiv 2506.12597) trains its masks towards a target sparsity (75%) and penalises overlap
between the experts' masks. The form follows SMAT (ICML 2024), as research-notes.md records:
the sparsity term is the expected L0 norm (`hard_concrete.prob_nonzero`), enforced by one
Lagrange multiplier per expert, raised by dual ascent while the expert's served mask is denser
than the target and reset to 0 once it is sparser (SMAT steps on its sampled masks). Overlap is
the expected fraction of parameters two experts both keep (under independence, density
squared); the orthogonality penalty is the mean pairwise cosine similarity of the experts'
masks (their overlap relative to their sizes), which decorrelates the masks without sparsifying
them. As in SMAT, each expert's Lagrangian term can be weighted by the router's (detached)
selection of it for the batch, and the router's squared logits are penalised.

Every quantity is over the whole model: gates split across the tensor-parallel group (row-parallel
layers) are summed over it with a forward all-reduce whose backward is the identity, so each rank
gets the exact gradient of its own gates.

Legend: M experts, I gated columns.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch import nn

from megamoe.simoe.config import SIMoEConfig


def interpolated_modules(model: nn.Module) -> list[nn.Module]:
    """Every SIMoE-interpolated module (linear or norm) of a model, in module order."""
    return [m for m in model.modules() if hasattr(m, "gated") and hasattr(m, "mask_logits")]


def _whole_model_sum(modules: list[nn.Module],
                     per_module: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                     served: bool = False) -> torch.Tensor:
    """Sum over modules of per_module(module, gates [M, I]): P(gate != 0) under U(0, 1) noise
    (differentiable), or with `served` 1 where the gate served is non-zero."""
    replicated, split, tp_group = 0.0, 0.0, None
    for module in modules:
        gated = module.gated
        gates_MI = (gated.served_nonzero if served else gated.prob_nonzero)(module.mask_logits)
        value = per_module(module, gates_MI)
        if module.splits_gates:
            split, tp_group = split + value, module.tp_group
        else:
            replicated = replicated + value
    if tp_group is not None:
        split = reduce_from_tensor_model_parallel_region(split, group=tp_group)
    return replicated + split


def total_gated_parameters(modules: list[nn.Module]) -> float:
    """Parameters under the gates, whole model (each expert covers all of them)."""
    ones = next(iter(modules)).mask_logits.new_ones((), dtype=torch.float32)
    return float(_whole_model_sum(modules, lambda m, _: ones * m.gated.covered_parameters))


def _density(modules: list[nn.Module], total: float, served: bool) -> torch.Tensor:
    return _whole_model_sum(modules, lambda m, p_MI: p_MI.sum(dim=1) * m.gated.rows,
                            served) / total


def expected_density(modules: list[nn.Module], total: float) -> torch.Tensor:
    """[M]: the expected fraction of the delta each expert keeps (1 - its sparsity)."""
    return _density(modules, total, served=False)


def served_density(modules: list[nn.Module], total: float) -> torch.Tensor:
    """[M]: the fraction of the delta each expert's served mask keeps (gates above 0)."""
    return _density(modules, total, served=True)


def mask_overlap(modules: list[nn.Module], total: float, served: bool = False) -> torch.Tensor:
    """[M, M]: the expected fraction of the delta that experts m and m' both keep; with
    `served`, the fraction both served masks keep."""
    return _whole_model_sum(modules, lambda m, p_MI: (p_MI @ p_MI.t()) * m.gated.rows,
                            served) / total


def cosine_similarity(overlap_MM: torch.Tensor) -> torch.Tensor:
    """[M, M]: overlap_mm' / sqrt(overlap_mm overlap_m'm'), the masks' cosine similarity: how
    much two experts share relative to their sizes, so making every mask sparser does not lower
    it (the raw overlap falls with density squared, and a penalty on it sparsifies every mask:
    served density 0.06 for a target of 0.25 at weight 1 in the SIMoE study)."""
    norms_M = overlap_MM.diagonal().clamp_min(1e-12).sqrt()
    return overlap_MM / (norms_M[:, None] * norms_M[None, :])


def mean_pairwise(overlap_MM: torch.Tensor) -> torch.Tensor:
    """Mean of the off-diagonal entries (0 for a single expert)."""
    m = overlap_MM.shape[0]
    if m < 2:
        return overlap_MM.sum() * 0.0
    return (overlap_MM.sum() - overlap_MM.diagonal().sum()) / (m * (m - 1))


def router_logit_penalty(logits_BM: torch.Tensor, coefficient: float) -> torch.Tensor:
    """coefficient x the mean over sequences and experts of the squared router logits (SMAT,
    ICML 2024: 1e-4, against saturated selection scores)."""
    return coefficient * logits_BM.float().pow(2).mean()


class SparsityLagrangian(nn.Module):
    """One multiplier per expert pushing its expected density down to 1 - target_sparsity."""

    def __init__(self, simoe: SIMoEConfig) -> None:
        super().__init__()
        self.target_density = 1.0 - simoe.target_sparsity
        self.lr = simoe.lagrangian_lr
        self.register_buffer("multipliers", torch.zeros(simoe.num_experts))

    def penalty(self, density_M: torch.Tensor, weights_M: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """sum_m multiplier_m w_m (density_m - target); w_m 1 unless `weights_M` (SMAT: the
        router's detached selection scores, `simoe.selection_weighted_sparsity`)."""
        terms_M = self.multipliers * (density_M - self.target_density)
        if weights_M is not None:
            terms_M = terms_M * weights_M.detach().to(terms_M)
        return terms_M.sum()

    @torch.no_grad()
    def step(self, density_M: torch.Tensor) -> None:
        """Dual ascent once per optimizer step on the density of the masks served (as SMAT
        steps on its sampled masks' sparsity); an expert below its target is released (0)."""
        excess_M = density_M.detach().to(self.multipliers) - self.target_density
        raised_M = (self.multipliers + self.lr * excess_M).clamp_min(0.0)
        self.multipliers.copy_(torch.where(excess_M > 0, raised_M, torch.zeros_like(raised_M)))


class MaskRegularizer(nn.Module):
    """The sparsity Lagrangian plus the overlap penalty, for one SIMoE model (its multipliers
    are a buffer, saved with the model)."""

    def __init__(self, model: nn.Module, simoe: SIMoEConfig) -> None:
        super().__init__()
        self.lagrangian = SparsityLagrangian(simoe)
        self.orthogonality_coefficient = simoe.orthogonality_coefficient
        self.gated_modules = interpolated_modules(model)  # a plain list: not submodules here
        self.total = total_gated_parameters(self.gated_modules)

    def forward(self, selection_M: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to add to the LM loss, expected density per expert [M]); `selection_M` weighs
        each expert's Lagrangian term (detached; None: 1 each)."""
        density_M = expected_density(self.gated_modules, self.total)
        similarity = mean_pairwise(cosine_similarity(mask_overlap(self.gated_modules,
                                                                  self.total)))
        loss = self.lagrangian.penalty(density_M, selection_M) \
            + self.orthogonality_coefficient * similarity
        return loss, density_M

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """The Lagrangian's dual step, once per optimizer step; returns the metrics
        `simoe/density` (expected L0, mean over experts), `simoe/served_density` (what the
        served masks keep), `simoe/overlap` and `simoe/multiplier` (mean)."""
        density_M = expected_density(self.gated_modules, self.total)
        served_M = served_density(self.gated_modules, self.total)
        self.lagrangian.step(served_M)
        overlap = mean_pairwise(mask_overlap(self.gated_modules, self.total))
        return {"simoe/density": float(density_M.mean()),
                "simoe/served_density": float(served_M.mean()), "simoe/overlap": float(overlap),
                "simoe/multiplier": float(self.lagrangian.multipliers.mean())}
