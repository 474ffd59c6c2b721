"""Drop-Upcycling (Nakamura et al., arXiv 2502.19261) and small noise, as pure tensor functions.

Drop-upcycling partially re-initialises each expert after copying so that experts start out
diverse: a random subset of a fraction r of the expert's intermediate neurons (rows of the gate
and up projections, the matching columns of the down projection) is redrawn from a normal
distribution with the mean and std of the matrix being replaced. Each expert draws its own subset.
"""
from __future__ import annotations

import torch

from megamoe.upcycle.granular import MLPWeights


def dropped_neurons(ffn_size: int, ratio: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of round(ratio * ffn_size) distinct intermediate neurons, drawn uniformly."""
    count = int(ratio * ffn_size + 0.5)
    return torch.randperm(ffn_size, generator=generator)[:count]


def _redraw(matrix: torch.Tensor, index: torch.Tensor, dim: int,
            generator: torch.Generator) -> torch.Tensor:
    """`matrix` with the slices `index` along `dim` drawn from N(mean, std^2) of `matrix`."""
    out = matrix.clone()
    shape = list(matrix.shape)
    shape[dim] = len(index)
    fresh = torch.randn(shape, generator=generator, dtype=matrix.dtype)
    fresh = fresh * matrix.std() + matrix.mean()
    out.index_copy_(dim, index, fresh)
    return out


def drop_upcycle(mlp: MLPWeights, ratio: float, generator: torch.Generator) -> MLPWeights:
    """Re-initialise a random fraction `ratio` of the expert's intermediate neurons
    (arXiv 2502.19261): rows of gate and up, columns of fc2, each matrix from its own mean/std."""
    index = dropped_neurons(mlp.ffn_size, ratio, generator)
    gate = _redraw(mlp.gate, index, 0, generator) if mlp.gated else None
    return MLPWeights.from_parts(gate, _redraw(mlp.up, index, 0, generator),
                                 _redraw(mlp.fc2, index, 1, generator))


def add_noise(mlp: MLPWeights, relative_std: float, generator: torch.Generator) -> MLPWeights:
    """Add N(0, (relative_std * std(W))^2) noise to every matrix W of the MLP."""

    def noisy(matrix: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(matrix.shape, generator=generator, dtype=matrix.dtype)
        return matrix + noise * (relative_std * matrix.std())

    return MLPWeights.from_parts(noisy(mlp.gate) if mlp.gated else None, noisy(mlp.up),
                                 noisy(mlp.fc2))
