"""Muon: momentum orthogonalised by Newton-Schulz, for the matrices of a network's hidden layers.

Update of one matrix W with gradient G (Jordan et al. 2024; "Muon is Scalable for LLM Training",
Moonlight, arXiv 2502.16982, Algorithm 1):
    B <- mu B + G                              (momentum buffer; mu = 0.95)
    M = G + mu B  (Nesterov)  or  M = B
    O = NS(M) * scale(rows, cols)              (`newton_schulz`: M's orthogonal factor U Vᵀ)
    W <- W (1 - lr wd) - lr O                  (decoupled weight decay, as AdamW)
`scale` (the `scale` setting):
- "moonlight" (default): 0.2 sqrt(max(rows, cols)). U Vᵀ has RMS 1/sqrt(max(rows, cols)); the
  factor gives the update an RMS of 0.2, AdamW's typical update RMS, so Muon takes AdamW's
  learning rate and weight decay unchanged (Moonlight, section 2.2).
- "jordan": sqrt(max(1, rows / cols)) (Jordan et al.'s original, with its own learning rate).
- "none": 1.
`rows, cols` are those of the whole matrix, never of a tensor-parallel shard.

Which matrices: each parameter comes with a `Matrix` (megamoe.optim.params classifies a model's
parameters): whether its leading dimension stacks independent experts (each expert's matrix
orthogonalised on its own: a batch of Newton-Schulz iterations), whether its rows are the two
halves of a gated linear unit (orthogonalised separately), and the dimension along which
tensor parallelism splits it. A tensor-parallel shard is orthogonalised as part of its full
matrix: the momentum is all-gathered over `tp_group` along that dimension, the full matrix
orthogonalised (the same on every rank) and this rank's slice kept, so the update is the one
process's whatever the tensor-parallel size. Newton-Schulz commutes with permutations of rows
and of columns (NS(P M Q) = P NS(M) Q), so the order in which shards or fused blocks are laid
out does not matter, only which rows form one matrix.
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Optional

import torch
import torch.distributed as dist

from megamoe.errors import ConfigError
from megamoe.optim.newton_schulz import (
    DEFAULT_STEPS,
    JORDAN_COEFFICIENTS,
    check_newton_schulz,
    newton_schulz,
)

SCALES = ("moonlight", "jordan", "none")
MOONLIGHT_RMS = 0.2
# The run's Muon settings: a loaded state dict's groups keep them (only its state is loaded).
SETTINGS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "scale")


class Matrix(NamedTuple):
    """How a parameter is one or more matrices.

    stacked: dimension 0 stacks independent matrices (experts), each orthogonalised alone.
    glu_halves: the rows (of each matrix) are [gate; up] of a gated linear unit, each half its
        own matrix; with tensor parallelism each rank holds [gate shard; up shard].
    tp_dim: the matrix dimension (0 rows, 1 columns) tensor parallelism shards, or None when
        this rank holds the whole matrix.
    """

    stacked: bool = False
    glu_halves: bool = False
    tp_dim: Optional[int] = None


def update_scale(scale: str, rows: int, cols: int) -> float:
    """The factor that multiplies the orthogonalised momentum of a rows x cols matrix."""
    if scale == "moonlight":
        return MOONLIGHT_RMS * math.sqrt(max(rows, cols))
    if scale == "jordan":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def check_scale(scale: str, where: str = "optimizer.muon") -> None:
    if scale not in SCALES:
        raise ConfigError(f"{where}.scale={scale!r} is not one of {list(SCALES)}")


def _gathered(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def orthogonalised(m: torch.Tensor, matrix: Matrix, steps: int,
                   coefficients: tuple[float, float, float], scale: str,
                   tp_group=None) -> torch.Tensor:
    """The scaled orthogonal factor of momentum `m` (this rank's part of the parameter laid out
    as `matrix` says), in fp32 and m's shape."""
    tp = dist.get_world_size(tp_group) if matrix.tp_dim is not None and tp_group is not None \
        else 1
    dim = m.dim() - 2 + matrix.tp_dim if tp > 1 else None
    parts = m.chunk(2, dim=-2) if matrix.glu_halves else (m,)
    out = []
    for part in parts:
        full = _gathered(part, dim, tp_group) if dim is not None else part
        o = newton_schulz(full, steps, coefficients) * update_scale(scale, *full.shape[-2:])
        out.append(o.chunk(tp, dim=dim)[dist.get_rank(tp_group)] if dim is not None else o)
    return torch.cat(out, dim=-2) if len(out) > 1 else out[0]


def init_state(state: dict, param: torch.Tensor) -> None:
    """A parameter's Muon state before its first update: a zero momentum buffer and the count
    of updates (a float tensor, as torch's Adam keeps it, so checkpoint code that reads one
    common step over the optimizers of a run finds it here too)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(param)
        state["step"] = torch.tensor(0.0)


class Muon(torch.optim.Optimizer):
    """Muon over parameter groups whose dicts carry, besides `params`, `matrices`: one `Matrix`
    per parameter (see the module docstring). Every parameter must be a matrix (2-D, or 3-D
    when stacked); the others belong to AdamW (`megamoe.optim.params.split_parameters`).

    tp_group: the tensor-parallel process group of the parameters with a `tp_dim` (None: no
    tensor parallelism). Gradients are taken as they are: data-parallel reduction is the
    caller's, so every data-parallel rank computes the same update."""

    def __init__(self, params: Iterable, lr: float = 3e-4, momentum: float = 0.95,
                 nesterov: bool = True, weight_decay: float = 0.1,
                 ns_steps: int = DEFAULT_STEPS,
                 ns_coefficients: tuple[float, float, float] = JORDAN_COEFFICIENTS,
                 scale: str = "moonlight", tp_group=None) -> None:
        check_newton_schulz(ns_steps, tuple(ns_coefficients))
        check_scale(scale)
        if not 0 <= momentum < 1:
            raise ConfigError(f"optimizer.muon.momentum={momentum} must be in [0, 1)")
        self.tp_group = tp_group
        self._matrices: list[list[Matrix]] = []
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      weight_decay=weight_decay, ns_steps=ns_steps,
                                      ns_coefficients=tuple(ns_coefficients), scale=scale))

    def add_param_group(self, param_group: dict) -> None:
        """torch's, keeping the group's `matrices` beside it (index for index with its params,
        so a wrapper that swaps a parameter for its fp32 main copy keeps its layout)."""
        group = dict(param_group)
        matrices = list(group.pop("matrices"))
        super().add_param_group(group)
        params = self.param_groups[-1]["params"]
        if len(matrices) != len(params):
            raise ConfigError(f"Muon: a parameter group has {len(params)} parameters but "
                              f"{len(matrices)} matrices")
        for param, matrix in zip(params, matrices):
            if param.dim() != 2 + matrix.stacked:
                raise ConfigError(f"Muon: a parameter of shape {list(param.shape)} is not "
                                  f"{'a stack of matrices' if matrix.stacked else 'a matrix'}")
        self._matrices.append(matrices)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's; the groups keep this optimizer's Muon settings (they are the run's)."""
        kept = [{key: group[key] for key in SETTINGS} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, settings in zip(self.param_groups, kept):
            group.update(settings)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, matrices in zip(self.param_groups, self._matrices):
            mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            for param, matrix in zip(group["params"], matrices):
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                init_state(state, param)
                state["step"] += 1
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(grad)
                m = grad.add(buf, alpha=mu) if group["nesterov"] else buf
                update = orthogonalised(m, matrix, group["ns_steps"], group["ns_coefficients"],
                                        group["scale"], self.tp_group)
                param.mul_(1 - lr * wd)
                param.add_(update.to(param.dtype), alpha=-lr)
        return loss
