"""Sparse interpolated parameters: W_b = W0 + (sum_m a_bm z_m) * Delta, one merge per sequence.

SIMoE (Chen, Wei, Schwarz, ACL 2025, arXiv 2506.12597), with the parametrisation of its
predecessor SMAT (ICML 2024): W0 is the frozen seed weight, Delta one shared trainable set
(zero-initialised, so the model starts as the dense one), z_m the hard-concrete mask of expert m
(`megamoe.simoe.hard_concrete`), a_bm the prompt router's merging coefficient for sequence b.

Structure of the masks (SMAT's structured mode): one gate per input column of a 2-D weight,
shared by the column's rows; one per element of a 1-D parameter (the norms' scales). A fused
Megatron weight (QKV, the GLU's gate+up) is one matrix here: its parts share the column gates.

Because a column gate scales a whole column, the merged product needs no merged weight:
x · (W0 + c_b * Delta)^T = x · W0^T + (c_b * x) · Delta^T with c_b = a_b · z over columns. The
interpolated linears run Megatron-Core's own partition product twice (frozen W0, then Delta on the
rescaled input), so tensor parallelism, its communication and its gradient reductions are
Megatron's. Column-parallel layers keep all input columns on every rank (the gates are replicated;
Megatron all-reduces the input gradient, which makes their gradient whole); row-parallel layers
split the columns, and the gates with them.

Legend: M experts, B sequences, S positions, I input columns (local), O output rows (local).
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn

from megamoe.errors import ConfigError
from megamoe.simoe.config import SIMoEConfig
from megamoe.simoe.hard_concrete import (clip_log_alpha, deterministic_gates, prob_nonzero,
                                         sample_gates)
from megamoe.simoe.merge import MergeState


def input_columns(weight: torch.Tensor, tp_group, split: bool) -> tuple[int, slice]:
    """(input columns of the whole weight, this rank's slice of them) for a parallel linear's
    local weight [O, I]: row-parallel layers (`split`) hold one contiguous slice per TP rank."""
    local = weight.shape[1]
    if not split:
        return local, slice(None)
    return local * tp_group.size(), slice(tp_group.rank() * local, (tp_group.rank() + 1) * local)


def replicated_randn(shape: tuple[int, int], std: float, shard: slice, like: torch.Tensor
                     ) -> torch.Tensor:
    """N(0, std) drawn at the full shape from the default generator, then sliced along dim 1, so
    every tensor-parallel layout draws the same numbers (ranks share the default seed)."""
    return (torch.randn(shape, device=like.device) * std)[:, shard].to(like.dtype)


class GatedColumns:
    """The M hard-concrete gates over a parameter's columns (or elements), a part of its module.

    The module's parameter `mask_logits` [M, local columns] holds log_alpha / `scale`, so Adam
    moves log_alpha `simoe.mask_lr_scale` times faster than the delta with one learning rate;
    log_alpha is clipped to +-`simoe.log_alpha_clip`. Training draws the noise u from
    U(1/2 - `simoe.gate_noise`, 1/2 + `simoe.gate_noise`); the gates served are those at u = 1/2.
    With `simoe.straight_through` a closed (or fully open) gate still gets the loss's gradient.
    `columns` is the number of gated columns in the whole (unsplit) parameter and `shard` the
    local ones. `rows` is how many parameters of the whole model one local gate covers: the
    column's rows on every tensor-parallel rank when the gates are replicated (column-parallel),
    its local rows when the gates are split with the columns (row-parallel), 1 for a norm.
    """

    def __init__(self, module: nn.Module, simoe: SIMoEConfig, columns: int, shard: slice,
                 rows: int, like: torch.Tensor) -> None:
        self.scale = simoe.mask_lr_scale
        self.clip, self.noise = simoe.log_alpha_clip, simoe.gate_noise
        self.straight_through = simoe.straight_through
        module.mask_logits = nn.Parameter(replicated_randn(
            (simoe.num_experts, columns), simoe.log_alpha_init_std / self.scale, shard, like))
        self.columns, self.shard, self.rows = columns, shard, rows
        self.covered_parameters = len(range(columns)[shard]) * rows
        """Parameters these (local) gates cover, counted as `rows` says."""

    def log_alpha(self, mask_logits_MI: torch.Tensor) -> torch.Tensor:
        return clip_log_alpha(mask_logits_MI * self.scale, self.clip)

    def gates(self, mask_logits_MI: torch.Tensor, training: bool) -> torch.Tensor:
        log_alpha_MI = self.log_alpha(mask_logits_MI)
        if not training:
            return deterministic_gates(log_alpha_MI)
        uniform_MI = torch.rand((log_alpha_MI.shape[0], self.columns),
                                device=log_alpha_MI.device)[:, self.shard]
        noise_MI = 0.5 + (2.0 * uniform_MI - 1.0) * self.noise
        return sample_gates(log_alpha_MI, noise_MI.to(log_alpha_MI.dtype), self.straight_through)

    def prob_nonzero(self, mask_logits_MI: torch.Tensor) -> torch.Tensor:
        """P(z != 0) per gate under U(0, 1) noise, [M, I] (the expected L0 of each column)."""
        return prob_nonzero(self.log_alpha(mask_logits_MI.float()))

    def served_nonzero(self, mask_logits_MI: torch.Tensor) -> torch.Tensor:
        """1 where the served gate is non-zero, else 0, [M, I]."""
        return (deterministic_gates(self.log_alpha(mask_logits_MI.float())) > 0).float()


def column_scales(coefficients_BM: torch.Tensor, gates_MI: torch.Tensor, dtype: torch.dtype
                  ) -> torch.Tensor:
    """c_BI = a_BM · z_MI: how much of Delta's column i sequence b merges in."""
    return coefficients_BM.to(dtype) @ gates_MI.to(dtype)


class _InterpolatedLinear:
    """Mixin over a Megatron-Core parallel linear: frozen W0, trainable Delta, column gates."""

    _split_columns: bool  # row-parallel layers split the input columns over the TP group
    _weight_split_dim: int

    def _make_interpolated(self, merge: MergeState, simoe: SIMoEConfig) -> None:
        self.weight.requires_grad_(False)
        self.delta_weight = nn.Parameter(torch.zeros_like(self.weight))
        copy_tensor_model_parallel_attributes(self.delta_weight, self.weight)
        rows = self.weight.shape[0]
        columns, shard = input_columns(self.weight, self.tp_group, self._split_columns)
        replicas = 1 if self._split_columns else self.tp_group.size()
        self.gated = GatedColumns(self, simoe, columns, shard, rows * replicas, self.weight)
        if self._split_columns:
            set_tensor_model_parallel_attributes(self.mask_logits, True, 1, 1)
        self.merge = merge

    @property
    def splits_gates(self) -> bool:
        """Whether this rank holds only a slice of the gates (they are TP-sharded)."""
        return self._split_columns and self.tp_group.size() > 1

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 - Megatron's names
        frozen = super()._forward_impl(input, weight, *args, **kwargs)
        if self.merge.seed_only:
            return frozen
        coefficients_BM = self.merge.require()
        if self._split_columns:
            # Every rank's columns read a_BM: its gradient is the sum over the TP group.
            coefficients_BM = copy_to_tensor_model_parallel_region(coefficients_BM,
                                                                   group=self.tp_group)
        gates_MI = self.gated.gates(self.mask_logits, self.training)
        scales_BI = column_scales(coefficients_BM, gates_MI, input.dtype)
        kwargs["bias"] = None
        return frozen + super()._forward_impl(input * scales_BI, self.delta_weight, *args,
                                              **kwargs)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axis = self._weight_split_dim
        axes = {"weight": axis, "delta_weight": axis}
        if axis == 0:
            axes["bias"] = 0
        else:
            axes["mask_logits"] = 1
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


class InterpolatedColumnParallelLinear(_InterpolatedLinear, ColumnParallelLinear):
    """Megatron's ColumnParallelLinear (QKV, MLP fc1) as a SIMoE interpolated weight."""

    _split_columns = False
    _weight_split_dim = 0

    def __init__(self, *args, merge: MergeState, simoe: SIMoEConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._make_interpolated(merge, simoe)


class InterpolatedRowParallelLinear(_InterpolatedLinear, RowParallelLinear):
    """Megatron's RowParallelLinear (attention output, MLP fc2) as a SIMoE interpolated weight."""

    _split_columns = True
    _weight_split_dim = 1

    def __init__(self, *args, merge: MergeState, simoe: SIMoEConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._make_interpolated(merge, simoe)


class InterpolatedNorm(nn.Module):
    """LayerNorm / RMSNorm whose scale is interpolated per element: g_b = g0 + c_b * delta.

    The seed's scale (and LayerNorm's shift, frozen, not interpolated) keep their Megatron names,
    so a dense checkpoint loads into it unchanged.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, merge: MergeState,
                 simoe: SIMoEConfig) -> None:
        super().__init__()
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ConfigError("SIMoE norms do not support layernorm_zero_centered_gamma=True; "
                              "set it to false")
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size),
                                                       requires_grad=False)
        self.delta_weight = nn.Parameter(torch.zeros(hidden_size))
        self.gated = GatedColumns(self, simoe, hidden_size, slice(None), 1, self.weight)
        self.merge = merge
        self.splits_gates = False

    def forward(self, x_SBH: torch.Tensor) -> torch.Tensor:
        shape = (x_SBH.shape[-1],)
        if self.rms:
            normed_SBH = torch.nn.functional.rms_norm(x_SBH, shape, None, self.eps)
        else:
            normed_SBH = torch.nn.functional.layer_norm(x_SBH, shape, None, None, self.eps)
        scale_BH = self.weight
        if not self.merge.seed_only:
            gates_MH = self.gated.gates(self.mask_logits, self.training)
            scales_BH = column_scales(self.merge.require(), gates_MH, x_SBH.dtype)
            scale_BH = self.weight + scales_BH * self.delta_weight
        out_SBH = normed_SBH * scale_BH
        return out_SBH if self.bias is None else out_SBH + self.bias
