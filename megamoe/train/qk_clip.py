"""MuonClip's QK-clip (Kimi K2, arXiv 2507.20534, sec. 2.1): after each optimizer step, every
attention head whose largest attention logit of the step exceeded a threshold tau has its query
and key projections scaled down so that the logit would have been tau.

Per head h, S_max = max over the step's training tokens of the pre-softmax logit
softmax_scale * q_i . k_j (causal positions only) and gamma = tau / S_max. A head with
S_max > tau is rescaled, the others are left alone:
- multi-head (and grouped-query) attention: W_q *= sqrt(gamma), W_k *= sqrt(gamma), so the logit
  scales by gamma. A key/value head of grouped-query attention serves several query heads; its
  group takes the smallest gamma of its heads (as Megatron-Core's `SelfAttention.clip_qk`).
  A query/key bias is scaled with its weight (the logit stays bilinear in the scaled q and k).
- MLA: the head-specific no-RoPE query and key components (q_C, k_C) by sqrt(gamma), the
  head-specific RoPE query q_R by gamma, the RoPE key k_R, shared by all heads, untouched
  (the paper's per-component rule; Megatron-Core's `MLASelfAttention.clip_qk` the same).

Megatron-Core's attention records the per-head max logit only through Transformer Engine
(`return_max_logit`); its local `DotProductAttention` (the CPU path) does not, and its
`clip_qk` rewrites a distributed optimizer's main weights as if they were whole tensors, while
with bf16 they are flat shards. So `QKClip` records the logits with a forward pre-hook on each
core attention (one extra q.kᵀ product per layer, in training mode only) and rescales the model
weights and, where they are separate (bf16), the optimizer's fp32 main weights or their shard.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_layer import TransformerLayer

from megamoe.errors import ConfigError
from megamoe.megatron.compat import transformer_layer_number


def head_max_logits(query: torch.Tensor, key: torch.Tensor, softmax_scale: float,
                    attention_mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
    """Per query head, the largest pre-softmax logit softmax_scale * q_i . k_j over the batch
    and the positions attended to: query [sq, b, heads, d], key [sk, b, groups, d] (each key
    head serves heads/groups consecutive query heads, Megatron's layout); `attention_mask`
    (True = masked, broadcastable to [b, heads, sq, sk]) if given, else the causal mask when
    `causal`. Returns float32 [heads]."""
    heads, groups = query.size(2), key.size(2)
    key = key.repeat_interleave(heads // groups, dim=2)
    logits = torch.einsum("qbhd,kbhd->bhqk", query.float(), key.float()) * softmax_scale
    if attention_mask is None and causal:
        sq, sk = logits.shape[-2:]
        attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=logits.device).triu(1)
    if attention_mask is not None:
        logits = logits.masked_fill(attention_mask.bool(), float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def attention_layers(chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The self-attention modules (Megatron's `SelfAttention` or `MLASelfAttention`) of the
    model chunks, in order."""
    return [m for chunk in chunks for m in chunk.modules()
            if isinstance(m, (SelfAttention, MLASelfAttention))]


def _record_hook(core: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a core attention: fold this forward's per-head max logits into
    `core.current_max_attn_logits` (Megatron's name; training forwards only)."""
    if not core.training:
        return
    names = ("query", "key", "value", "attention_mask", "attn_mask_type")
    given = {**dict(zip(names, args)), **kwargs}
    mask_type = given.get("attn_mask_type") or core.attn_mask_type
    # With apply_query_key_layer_scaling Megatron divides softmax_scale by the layer number and
    # its softmax multiplies the scores back by it.
    scale = core.softmax_scale * (getattr(core.scale_mask_softmax, "scale", None) or 1.0)
    with torch.no_grad():
        logits = head_max_logits(given["query"], given["key"], scale,
                                 given.get("attention_mask"), mask_type == AttnMaskType.causal)
    seen = getattr(core, "current_max_attn_logits", None)
    core.current_max_attn_logits = logits if seen is None else torch.maximum(seen, logits)


def _row_scales(attention: torch.nn.Module, gamma: torch.Tensor
                ) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(linear module, factor per output row) for the projections QK-clip rescales, from the
    per-head gamma <= 1 (see the module docstring for which rows get which power)."""
    root = gamma.sqrt()
    if isinstance(attention, MLASelfAttention):
        c = attention.config
        q_proj = attention.linear_q_proj if c.q_lora_rank is None else attention.linear_q_up_proj
        q_rows = torch.cat([root[:, None].expand(-1, c.qk_head_dim),
                            gamma[:, None].expand(-1, c.qk_pos_emb_head_dim)], dim=1)
        kv_rows = torch.cat([root[:, None].expand(-1, c.qk_head_dim),
                             torch.ones_like(gamma)[:, None].expand(-1, c.v_head_dim)], dim=1)
        return [(q_proj, q_rows.reshape(-1)), (attention.linear_kv_up_proj, kv_rows.reshape(-1))]
    groups = attention.num_query_groups_per_partition
    head_dim = attention.hidden_size_per_attention_head
    per_group = gamma.view(groups, -1)
    group_root = per_group.min(dim=1).values.sqrt()
    rows = torch.cat([group_root[:, None].expand(-1, per_group.size(1) * head_dim),
                      group_root[:, None].expand(-1, head_dim),
                      torch.ones(groups, head_dim, dtype=gamma.dtype, device=gamma.device)], 1)
    return [(attention.linear_qkv, rows.reshape(-1))]


def _owned_range(optimizer, param: torch.nn.Parameter) -> tuple[int, int]:
    """(start, end) of `param`'s flattened elements whose fp32 main shard this rank's
    distributed optimizer holds."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if param in getattr(inner, "model_param_gbuf_map", {}):
            owned = inner._get_model_param_range_map(param)["param"]
            return owned.start, owned.end
    raise RuntimeError(f"no optimizer holds the main weights of a {tuple(param.shape)} parameter")


def _rescale(param: torch.nn.Parameter, rows: torch.Tensor, optimizer) -> None:
    """Multiply each output row of `param` (weight [out, in] or bias [out]) by `rows`, in the
    model and, where the optimizer keeps separate fp32 main weights, there too."""
    factor = rows.view(-1, *([1] * (param.dim() - 1))).expand_as(param)
    param.data.mul_(factor.to(param.dtype))
    main = getattr(param, "main_param", None)
    if main is None:
        return  # fp32: the optimizer updates the model's own weights
    if main.shape == param.shape:
        main.data.mul_(factor.to(main.dtype))
    else:
        start, end = _owned_range(optimizer, param)
        main.data.mul_(factor.reshape(-1)[start:end].to(main.dtype))


class QKClip:
    """Records each attention layer's per-head max logit during the step's forwards and,
    after the optimizer step, rescales the heads above `threshold` (see the module docstring);
    `apply` returns the logged metrics."""

    def __init__(self, chunks: list[torch.nn.Module], threshold: float) -> None:
        if not (isinstance(threshold, (int, float)) and math.isfinite(threshold)
                and threshold > 0):
            raise ConfigError(f"optimizer.qk_clip_threshold={threshold!r} must be a finite "
                              "number > 0 (Kimi K2 uses 100) or null")
        self.threshold = float(threshold)
        self.layers = attention_layers(chunks)
        # Global layer numbers, multi-token-prediction depths after the decoder's layers (an
        # attention module outside a TransformerLayer keeps its own).
        self.numbers = {id(layer.self_attention): transformer_layer_number(layer)
                        for chunk in chunks for layer in chunk.modules()
                        if isinstance(layer, TransformerLayer)}
        for attention in self.layers:
            # MLA's q/kv layer norms act on the latents, before the per-head projections.
            if attention.config.qk_layernorm and not isinstance(attention, MLASelfAttention):
                raise ConfigError("optimizer.qk_clip_threshold needs model.qk_layernorm=false: "
                                  "with normalised queries and keys, scaling their projections "
                                  "does not change the logits")
            attention.core_attention.register_forward_pre_hook(_record_hook, with_kwargs=True)

    def apply(self, optimizer) -> dict[str, float]:
        """After the optimizer step: the step's per-head max logits, maximised over the
        data-parallel replicas, clip the heads above the threshold; returns
        {"attention/layer{n}/max_logit": max over the layer's heads} (over all tensor-parallel
        ranks). Layers that ran no training forward this step are skipped."""
        layers = [a for a in self.layers
                  if getattr(a.core_attention, "current_max_attn_logits", None) is not None]
        if not layers:
            return {}
        logits = [a.core_attention.current_max_attn_logits for a in layers]
        flat = torch.cat(logits)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(
                flat, op=torch.distributed.ReduceOp.MAX,
                group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        per_layer = flat.split([len(x) for x in logits])
        with torch.no_grad():
            for attention, s_max in zip(layers, per_layer):
                gamma = (self.threshold / s_max).clamp(max=1.0)
                if bool((gamma < 1).any()):
                    for linear, rows in _row_scales(attention, gamma):
                        for param in (linear.weight, getattr(linear, "bias", None)):
                            if param is not None:
                                _rescale(param, rows, optimizer)
                attention.core_attention.current_max_attn_logits = None
        maxima = torch.stack([s.max() for s in per_layer])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX,
                                         group=parallel_state.get_tensor_model_parallel_group())
        return {f"attention/layer{self.numbers.get(id(a), a.layer_number)}/max_logit": float(m)
                for a, m in zip(layers, maxima)}
