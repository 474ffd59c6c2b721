"""Grouped experts: all local experts' weights stacked in two tensors.

fc1_weight [L, F', D] and fc2_weight [L, D, F] keep each expert's matrices in Megatron-Core's
(out, in) orientation (F' = 2F for swiglu, gate half first), so checkpoints map one-to-one onto
Megatron's per-expert `linear_fc1.weight` / `linear_fc2.weight`.

One kernel per device, chosen once: torch's grouped matmul on CUDA (one launch for all experts),
a per-expert loop of dense matmuls elsewhere (on CPU the loop is the fast path: each expert's
block is one large GEMM).

Shape legend: L local experts, D hidden, F expert FFN size, N rows (tokens sorted by expert).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megamoe.config import MoEConfig
from megamoe.experts.activations import ACTIVATIONS


class _LoopExpertMLP(torch.autograd.Function):
    """One dense MLP per expert over its contiguous block of rows, with a hand-written backward
    that writes every expert's gradients straight into the stacked gradient tensors (plain
    autograd over the loop would zero-fill and concatenate full-size buffers per expert).

    Per-expert buffers are allocated one expert at a time: on CPU, one large fresh buffer would
    page-fault inside the GEMMs on every step, where per-expert ones reuse heap memory.
    Saves each expert's pre-activation h and activation a (what the backward needs)."""

    @staticmethod
    def forward(ctx, x_ND, fc1_LFD, fc2_LDF, tokens_per_expert, activation):
        y_ND = x_ND.new_empty((x_ND.shape[0], fc2_LDF.shape[1]))
        saved = []
        blocks = zip(x_ND.split(tokens_per_expert), y_ND.split(tokens_per_expert),
                     fc1_LFD.unbind(0), fc2_LDF.unbind(0))
        for x_MD, y_MD, fc1_FD, fc2_DF in blocks:
            h_MF = x_MD @ fc1_FD.t()
            a_MF = activation.forward(h_MF)
            torch.mm(a_MF, fc2_DF.t(), out=y_MD)
            saved += [h_MF, a_MF]
        ctx.save_for_backward(x_ND, fc1_LFD, fc2_LDF, *saved)
        ctx.tokens_per_expert, ctx.activation = tokens_per_expert, activation
        return y_ND

    @staticmethod
    def backward(ctx, grad_y_ND):
        x_ND, fc1_LFD, fc2_LDF, *saved = ctx.saved_tensors
        split = ctx.tokens_per_expert
        grad_x_ND, grad_fc1, grad_fc2 = (torch.empty_like(t) for t in (x_ND, fc1_LFD, fc2_LDF))
        blocks = zip(x_ND.split(split), saved[0::2], saved[1::2],
                     grad_y_ND.contiguous().split(split), grad_x_ND.split(split),
                     fc1_LFD.unbind(0), fc2_LDF.unbind(0), grad_fc1.unbind(0),
                     grad_fc2.unbind(0))
        for x_MD, h_MF, a_MF, gy_MD, gx_MD, fc1_FD, fc2_DF, gfc1_FD, gfc2_DF in blocks:
            torch.mm(gy_MD.t(), a_MF, out=gfc2_DF)
            grad_h_MF = ctx.activation.backward(h_MF, gy_MD @ fc2_DF)
            torch.mm(grad_h_MF.t(), x_MD, out=gfc1_FD)
            torch.mm(grad_h_MF, fc1_FD, out=gx_MD)
        return grad_x_ND, grad_fc1, grad_fc2, None, None


def loop_expert_mlp(x_ND, tokens_per_expert, fc1_LFD, fc2_LDF, activation):
    """CPU path: one dense GEMM pair per expert (each expert's block is one large GEMM)."""
    return _LoopExpertMLP.apply(x_ND, fc1_LFD, fc2_LDF, list(tokens_per_expert), activation)


def grouped_mm_expert_mlp(x_ND, tokens_per_expert, fc1_LFD, fc2_LDF, activation):
    """CUDA path: torch's grouped GEMM, one kernel for all experts per projection."""
    offsets_L = torch.tensor(tokens_per_expert, device=x_ND.device).cumsum(0).to(torch.int32)
    h_NF = torch.nn.functional.grouped_mm(x_ND, fc1_LFD.transpose(1, 2), offs=offsets_L)
    return torch.nn.functional.grouped_mm(activation.forward(h_NF), fc2_LDF.transpose(1, 2),
                                          offs=offsets_L)


def pick_kernel(device: torch.device, dtype: torch.dtype) -> Callable:
    """The grouped-GEMM path on CUDA for bf16 (what torch's kernel supports), else the loop."""
    if device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch.nn.functional,
                                                                     "grouped_mm"):
        return grouped_mm_expert_mlp
    return loop_expert_mlp


class GroupedExperts(nn.Module):
    """The L routed experts held by this rank."""

    def __init__(self, cfg: MoEConfig, num_local_experts: int,
                 init_method: Optional[Callable] = None,
                 output_init_method: Optional[Callable] = None):
        super().__init__()
        fc1_out = cfg.ffn_hidden_size * (2 if cfg.gated else 1)
        self.fc1_weight = nn.Parameter(torch.empty(num_local_experts, fc1_out, cfg.hidden_size))
        self.fc2_weight = nn.Parameter(
            torch.empty(num_local_experts, cfg.hidden_size, cfg.ffn_hidden_size))
        default_init = lambda w: nn.init.normal_(w, 0.0, cfg.init_method_std)  # noqa: E731
        for expert in range(num_local_experts):
            (init_method or default_init)(self.fc1_weight.data[expert])
            (output_init_method or default_init)(self.fc2_weight.data[expert])
        for param in (self.fc1_weight, self.fc2_weight):
            param.allreduce = False  # Megatron DDP: expert grads reduce over expert-DP only
            # Not a copy of another tensor-parallel rank's weights (each expert-data-parallel
            # rank, tensor-parallel ranks included, owns its shard in the distributed
            # optimizer): Megatron's gradient norm counts them on every rank, as it does its own
            # expert weights, which carry these attributes.
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.activation = ACTIVATIONS[cfg.activation]

    @property
    def num_local_experts(self) -> int:
        return self.fc1_weight.shape[0]

    def forward(self, x_ND: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        kernel = pick_kernel(x_ND.device, x_ND.dtype)
        return kernel(x_ND, tokens_per_expert, self.fc1_weight, self.fc2_weight, self.activation)
