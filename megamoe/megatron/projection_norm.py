"""MiniMax-M2's query/key norm: one RMSNorm over a whole projection, not per head.

Megatron-Core's `qk_layernorm` normalises each query and key head on its own (Qwen3, GLM-4.5).
MiniMax-M2 normalises the query projection (heads x head size channels) with one RMSNorm and the
key projection with another (transformers' `MiniMaxM2Attention`: `q_norm` and `k_norm` of widths
`num_attention_heads * head_dim` and `num_key_value_heads * head_dim`, applied before the heads
are split). `ProjectionRMSNorm` takes the slot of Megatron's q/k norm, which sees the heads
already split ([s, b, heads, head size]), and `with_qk_norm_scope` puts it into a layer spec.

Tensor parallelism splits the heads, hence the projection: each rank holds its heads' slice of
the norm weight (a tensor-parallel parameter on axis 0, as a column-parallel output) and the
sum of squares is all-reduced over the tensor-parallel group, forward and backward, so every
rank normalises by the mean over the whole projection. Megatron-Core gives each tensor rank
whole key-value heads (megamoe requires `num_query_groups` divisible by the tensor size).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed.nn.functional as dist_fn
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

PARTS = ("query", "key")


class ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm (Zhang and Sennrich, arXiv 1910.07467) over all heads of a query or key
    projection: x * rsqrt(mean over heads and channels of x^2 + eps) * weight, in float32 and
    cast back before the weight, as transformers' RMSNorm computes it. `part`: "query" (the
    config's attention heads) or "key" (its query groups); this tensor rank holds its share."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, part: str = "query"):
        super().__init__()
        heads = config.num_attention_heads if part == "query" else \
            (config.num_query_groups or config.num_attention_heads)
        self.tensor_parallel = config.tensor_model_parallel_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(heads // self.tensor_parallel * hidden_size,
                                                    dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., this rank's heads, head size] -> the same shape, normalised over the
        projection's every head and channel."""
        flat = x.flatten(-2).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tensor_parallel > 1:
            squares = dist_fn.all_reduce(
                squares, group=parallel_state.get_tensor_model_parallel_group())
        mean = squares / (flat.shape[-1] * self.tensor_parallel)
        normed = flat * torch.rsqrt(mean + self.eps)
        return (self.weight * normed.to(x.dtype)).view_as(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """The weight as a checkpoint shard: this rank's slice of axis 0."""
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True),
                                                   prefix, {"weight": 0}, sharded_offsets)


def with_qk_norm_scope(layer: ModuleSpec, scope: str) -> ModuleSpec:
    """The transformer layer spec `layer` with its query and key norms replaced by
    `ProjectionRMSNorm` when `scope` (model.qk_layernorm_scope) is "projection"; unchanged for
    "head"."""
    if scope == "head":
        return layer
    attention = layer.submodules.self_attention
    norms = {f"{part[0]}_layernorm": ModuleSpec(module=ProjectionRMSNorm, params={"part": part})
             for part in PARTS}
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, **norms))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules,
                                                                     self_attention=attention))
