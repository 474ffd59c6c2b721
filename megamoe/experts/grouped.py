"""Grouped experts: all local experts' weights stacked in two tensors.

fc1_weight [L, F', D] and fc2_weight [L, D, F] keep each expert's matrices in Megatron-Core's
(out, in) orientation (F' = 2F for swiglu, gate half first), so checkpoints map one-to-one onto
Megatron's per-expert `linear_fc1.weight` / `linear_fc2.weight`. With `experts.bias` (GPT-OSS)
each expert also has fc1 and fc2 biases, Megatron's `linear_fc1.bias` / `linear_fc2.bias`, held
flat, fc1_bias [L F'] and fc2_bias [L D] (one expert after another), so that Megatron's
optimizer, which exempts one-dimensional parameters from weight decay, treats them as the
biases they are. Experts are never tensor-parallel in megamoe, so each bias is added once.

One kernel on every device: torch's grouped GEMM, `torch.nn.functional.grouped_mm` (the dropless
grouped-GEMM formulation of MegaBlocks, Gale et al., arXiv 2211.15841: one call per GEMM for all
local experts, row blocks delimited by int32 end offsets), on CPU as on CUDA, fp32 and bf16,
under one autograd Function whose backward is written out, so autograd and layouts are the same
on every device. On 2 CPU cores (`tools/bench_moe_layer.py` sizes, freed memory reused) it was as
fast as a per-expert loop of dense GEMMs at E16 and faster at E256 in fp32, and faster in bf16:
torch's CPU kernel is such a loop in C++, and the activation runs once over all rows instead of
once per expert. The loop (`LOOP`) stands in only where torch has no `grouped_mm` or an operand
breaks its 16-byte stride alignment (an expert width not a multiple of 16 bytes).

Shape legend: L local experts, D hidden (or latent: `MoEConfig.expert_width`), F expert FFN size
(F' fc1 rows), N rows (tokens sorted by expert), K, M the inner and outer sizes of one GEMM.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from megamoe.config import MoEConfig
from megamoe.experts.activations import Activation, expert_activation


class GroupedGemm(NamedTuple):
    """The two grouped products of an expert MLP, expert l owning the l-th block of rows.

    rows(a_NK, b_LKM, groups) -> [N, M]: each block of a's rows times its expert's b[l].
    outer(a_NK, b_NM, groups) -> [L, K, M]: per expert, its block of a, transposed, times its
        block of b (a weight gradient; zero for an expert with no rows).
    groups(tokens_per_expert, device): the block sizes in the form rows and outer take.
    """

    rows: Callable
    outer: Callable
    groups: Callable


def _end_offsets(tokens_per_expert: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(accumulate(tokens_per_expert)), dtype=torch.int32, device=device)


GROUPED_MM = GroupedGemm(
    rows=lambda a_NK, b_LKM, offsets_L: torch.nn.functional.grouped_mm(a_NK, b_LKM,
                                                                       offs=offsets_L),
    outer=lambda a_NK, b_NM, offsets_L: torch.nn.functional.grouped_mm(a_NK.t(), b_NM,
                                                                       offs=offsets_L),
    groups=_end_offsets)


def _loop_rows(a_NK, b_LKM, tokens_per_expert):
    out_NM = a_NK.new_empty((a_NK.shape[0], b_LKM.shape[2]))
    for a_block, b_KM, out_block in zip(a_NK.split(tokens_per_expert), b_LKM.unbind(0),
                                        out_NM.split(tokens_per_expert)):
        torch.mm(a_block, b_KM, out=out_block)
    return out_NM


def _loop_outer(a_NK, b_NM, tokens_per_expert):
    out_LKM = a_NK.new_empty((len(tokens_per_expert), a_NK.shape[1], b_NM.shape[1]))
    for a_block, b_block, out_KM in zip(a_NK.split(tokens_per_expert),
                                        b_NM.split(tokens_per_expert), out_LKM.unbind(0)):
        torch.mm(a_block.t(), b_block, out=out_KM)  # no rows: zeros
    return out_LKM


LOOP = GroupedGemm(rows=_loop_rows, outer=_loop_outer,
                   groups=lambda tokens_per_expert, device: list(tokens_per_expert))


def _add_per_expert(t_NM: torch.Tensor, bias_LM: torch.Tensor, rows_L: torch.Tensor) -> None:
    """t += each row's expert's bias, in place."""
    t_NM += bias_LM.to(t_NM.dtype).repeat_interleave(rows_L, dim=0, output_size=t_NM.shape[0])


def _sum_per_expert(t_NM: torch.Tensor, rows_L: torch.Tensor) -> torch.Tensor:
    """[L, M]: the sum of each expert's block of rows (zero for an expert with none), a bias
    gradient."""
    return torch.segment_reduce(t_NM, "sum", lengths=rows_L, axis=0)


class _ExpertMLP(torch.autograd.Function):
    """y = act(x fc1ᵀ + b1) fc2ᵀ + b2, each expert over its block of rows, through `gemm`
    (biases only when given).

    The backward is the MLP's four GEMMs and the activation's derivative, written out so it is
    the same for both kernels and each weight gradient is computed straight into one stacked
    tensor; a bias's gradient is the sum of its expert's rows of the gradient it is added to.
    Saves the pre-activation h and the activation a, what the backward needs."""

    @staticmethod
    def forward(ctx, x_ND, fc1_LFD, fc2_LDF, fc1_bias_LF, fc2_bias_LD, gemm: GroupedGemm,
                groups, rows_L, activation: Activation):
        h_NF = gemm.rows(x_ND, fc1_LFD.transpose(1, 2), groups)
        if fc1_bias_LF is not None:
            _add_per_expert(h_NF, fc1_bias_LF, rows_L)
        a_NF = activation.forward(h_NF)
        ctx.save_for_backward(x_ND, fc1_LFD, fc2_LDF, h_NF, a_NF, rows_L)
        ctx.gemm, ctx.groups, ctx.activation = gemm, groups, activation
        ctx.biased = fc1_bias_LF is not None
        y_ND = gemm.rows(a_NF, fc2_LDF.transpose(1, 2), groups)
        if fc2_bias_LD is not None:
            _add_per_expert(y_ND, fc2_bias_LD, rows_L)
        return y_ND

    @staticmethod
    def backward(ctx, grad_y_ND):
        x_ND, fc1_LFD, fc2_LDF, h_NF, a_NF, rows_L = ctx.saved_tensors
        gemm, groups = ctx.gemm, ctx.groups
        grad_y_ND = _row_major(grad_y_ND)
        grad_h_NF = ctx.activation.backward(h_NF, gemm.rows(grad_y_ND, fc2_LDF, groups))
        grad_biases = ((_sum_per_expert(grad_h_NF, rows_L), _sum_per_expert(grad_y_ND, rows_L))
                       if ctx.biased else (None, None))
        return (gemm.rows(grad_h_NF, fc1_LFD, groups), gemm.outer(grad_h_NF, x_ND, groups),
                gemm.outer(grad_y_ND, a_NF, groups), *grad_biases, None, None, None, None)


def _row_major(t_NM: torch.Tensor) -> torch.Tensor:
    """t with row-major strides: an expanded gradient (of a sum) has zero strides, which
    grouped_mm rejects, and `contiguous()` keeps them when t is empty."""
    if t_NM.stride() == (t_NM.shape[1], 1):
        return t_NM
    return t_NM.clone(memory_format=torch.contiguous_format)


def grouped_mm_fits(x_ND: torch.Tensor, fc2_LDF: torch.Tensor) -> bool:
    """torch has `grouped_mm` and every operand's row stride (D and F elements, F' = F or 2F)
    is a multiple of 16 bytes, as it requires."""
    D, F = fc2_LDF.shape[1:]
    return hasattr(torch.nn.functional, "grouped_mm") and (
        D * x_ND.element_size() % 16 == 0 and F * x_ND.element_size() % 16 == 0)


def expert_mlp(x_ND: torch.Tensor, tokens_per_expert: list[int], fc1_LFD: torch.Tensor,
               fc2_LDF: torch.Tensor, activation: Activation,
               gemm: Optional[GroupedGemm] = None, fc1_bias_LF: Optional[torch.Tensor] = None,
               fc2_bias_LD: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every local expert's MLP over its block of rows of x (rows sorted by expert,
    `tokens_per_expert` of them each), through `gemm`: by default `GROUPED_MM` where it fits,
    else `LOOP`; with both biases or neither."""
    if gemm is None:
        gemm = GROUPED_MM if grouped_mm_fits(x_ND, fc2_LDF) else LOOP
    groups = gemm.groups(tokens_per_expert, x_ND.device)
    rows_L = (torch.tensor(tokens_per_expert, dtype=torch.int64, device=x_ND.device)
              if fc1_bias_LF is not None else None)
    return _ExpertMLP.apply(_row_major(x_ND), fc1_LFD, fc2_LDF, fc1_bias_LF, fc2_bias_LD, gemm,
                            groups, rows_L, activation)


class GroupedExperts(nn.Module):
    """The L routed experts held by this rank."""

    def __init__(self, cfg: MoEConfig, num_local_experts: int,
                 init_method: Optional[Callable] = None,
                 output_init_method: Optional[Callable] = None):
        super().__init__()
        fc1_out = cfg.ffn_hidden_size * (2 if cfg.experts.gated else 1)
        D = cfg.expert_width
        self.fc1_weight = nn.Parameter(torch.empty(num_local_experts, fc1_out, D))
        self.fc2_weight = nn.Parameter(torch.empty(num_local_experts, D, cfg.ffn_hidden_size))
        default_init = lambda w: nn.init.normal_(w, 0.0, cfg.init_method_std)  # noqa: E731
        for expert in range(num_local_experts):
            (init_method or default_init)(self.fc1_weight.data[expert])
            (output_init_method or default_init)(self.fc2_weight.data[expert])
        self.fc1_bias = self.fc2_bias = None
        if cfg.experts.bias:  # zeros, as Megatron's linear biases start
            self.fc1_bias = nn.Parameter(torch.zeros(num_local_experts * fc1_out))
            self.fc2_bias = nn.Parameter(torch.zeros(num_local_experts * D))
        for param in self.parameters():
            param.allreduce = False  # Megatron DDP: expert grads reduce over expert-DP only
            # Not a copy of another tensor-parallel rank's weights (each expert-data-parallel
            # rank, tensor-parallel ranks included, owns its shard in the distributed
            # optimizer): Megatron's gradient norm counts them on every rank, as it does its own
            # expert weights, which carry these attributes.
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.activation = expert_activation(cfg.experts)

    @property
    def num_local_experts(self) -> int:
        return self.fc1_weight.shape[0]

    def biases(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The fc1 and fc2 biases as [L, F'] and [L, D] views (None, None without biases)."""
        if self.fc1_bias is None:
            return None, None
        L = self.num_local_experts
        return self.fc1_bias.view(L, -1), self.fc2_bias.view(L, -1)

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        fc1_bias_LF, fc2_bias_LD = self.biases()
        return expert_mlp(x_ND, tokens_per_expert, self.fc1_weight, self.fc2_weight,
                          self.activation, fc1_bias_LF=fc1_bias_LF, fc2_bias_LD=fc2_bias_LD)
