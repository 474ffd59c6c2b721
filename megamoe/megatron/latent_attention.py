"""Multi-head Latent Attention (MLA; DeepSeek-V2, arXiv 2405.04434, sec. 2.1; DeepSeek-V3,
arXiv 2412.19437) through Megatron-Core's own `MLASelfAttention`, with its local modules.

Two repairs of Megatron's local MLA (0.16.1 and 0.19.2), both in its core attention, which
`with_latent_attention` puts into Megatron's local MLA layer spec:
- Megatron's MLA asks its core attention for keys and values of different widths
  (`k_channels`: the no-RoPE plus RoPE head dimension, `v_channels`: the value head
  dimension), which Transformer Engine's attention takes and the local `DotProductAttention`
  does not. `LatentDotProductAttention` takes them.
- The RoPE part of the key (sec. 2.1.3) is one vector per token shared by all heads. With
  tensor parallelism the local spec's column-parallel down projection is gathered, so every
  tensor rank holds that vector whole and uses it for its own heads, but the gather's
  backward only splits the gradient: the key's RoPE gradient reaching the down projection is
  the sum over one rank's heads instead of all heads. (Transformer Engine's spec duplicates
  the down projection and gathers along the sequence, whose backward sums; NVIDIA/Megatron-LM
  issue 1699.) The core attention sums that gradient over the tensor-parallel group.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megamoe.megatron import compat


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (for a tensor every rank of
    the group holds whole and uses for its own share of the work)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LatentDotProductAttention(DotProductAttention):
    """Megatron's local softmax attention for MLA's query/key width `k_channels` and value
    width `v_channels` (its forward already multiplies keys and values of any width; only
    the width of the output, heads x `v_channels`, is set here), whose keys' shared RoPE part
    gets its gradient from every tensor-parallel rank's heads (see the module docstring).

    Megatron's Attention base first builds its core attention without the two widths and MLA
    then replaces it, so both default to the config's `kv_channels` (and no RoPE part)."""

    def __init__(self, *args: Any, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        self.rope_channels = self.config.qk_pos_emb_head_dim if k_channels is not None else 0

    def forward(self, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any):
        """Megatron's attention, `key` [S, B, heads, qk_head_dim + rope] with its RoPE part's
        gradient summed over the tensor-parallel group."""
        if self.rope_channels and self.tp_group.size() > 1:
            content, rope = key.split([key.shape[-1] - self.rope_channels,
                                       self.rope_channels], dim=-1)
            key = torch.cat([content, _SumGradientOverGroup.apply(rope, self.tp_group)], -1)
        return super().forward(query, key, *args, **kwargs)


def with_latent_attention(layer_spec: ModuleSpec, query_latent: bool) -> ModuleSpec:
    """Megatron's local MLA layer spec with `LatentDotProductAttention` as its core attention.
    The latent norms are the spec's (from its `qk_layernorm`), but for a model without a
    query latent (`q_lora_rank=None`), which has no query norm (0.19 refuses one)."""
    norms = {} if query_latent else {"q_layernorm": IdentityOp}
    attention = compat.replace_submodules(layer_spec.submodules.self_attention,
                                          core_attention=LatentDotProductAttention, **norms)
    return compat.replace_submodules(layer_spec, self_attention=attention)
