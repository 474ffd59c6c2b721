"""GPT-OSS's core attention with Megatron-Core's local modules: one learned sink logit per head
and sliding windows, on any device and at any tensor-parallel size.

The model states both in Megatron-Core's own TransformerConfig fields, which its Transformer
Engine attention (`TEDotProductAttention`, Transformer Engine >= 2.8) reads too:
- `softmax_type="learnable"`: a parameter `softmax_offset` of one logit per attention head
  (sharded with the heads over tensor-parallel ranks, checkpointed under
  `...self_attention.core_attention.softmax_offset`) joins each query's softmax as one more
  column, which is then dropped: p_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik)) (GPT-OSS;
  Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453).
- `window_size=(left, right)` on the layers `window_attn_skip_freq` picks: query i sees key j
  when i - left <= j <= i + right (and j <= i, causal). GPT-OSS's window of w tokens is
  (w - 1, 0).

Megatron's local `DotProductAttention` states the same but cannot run them on the CPU (0.16.1,
0.19.2): its constructor allocates the sinks on `torch.cuda.current_device()` whatever
`use_cpu_initialization` says, and its softmax builds the window mask on "cuda" and then uses it
instead of the attention mask it was given. `SinkDotProductAttention` is that module with the
sinks built where the config puts weights and `SinkSoftmax` as its softmax.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from megamoe.megatron import compat


class SinkSoftmax(torch.nn.Module):
    """Attention probabilities [b, heads, sq, sk] from raw scores: scaled by `scale` (Megatron's
    query-key layer scaling; None: 1), keys hidden by the given boolean mask (True: hidden),
    by causality and by the sliding window `window` ((left, right) as Megatron's
    `window_size`, -1 unbounded; None: none), then the softmax in fp32 with each head's sink
    logit as one more key whose probability is dropped (no sinks: the plain softmax).
    Returned in the scores' dtype. The last query is aligned with the last key (sq < sk:
    queries after a cache)."""

    def __init__(self, causal: bool, window: Optional[tuple[int, int]],
                 scale: Optional[float] = None):
        super().__init__()
        self.causal = causal
        self.window = window
        self.scale = scale

    def hidden(self, sq: int, sk: int, device: torch.device) -> Optional[torch.Tensor]:
        """[sq, sk] True where causality or the window hides key j from query i (None: no
        such rule)."""
        if not self.causal and self.window is None:
            return None
        query = torch.arange(sk - sq, sk, device=device)[:, None]
        key = torch.arange(sk, device=device)[None, :]
        hidden = key > query if self.causal else torch.zeros(sq, sk, dtype=torch.bool,
                                                             device=device)
        if self.window is not None:  # -1: no bound on that side, as Megatron's field says
            left, right = self.window
            if left >= 0:
                hidden = hidden | (key < query - left)
            if right >= 0:
                hidden = hidden | (key > query + right)
        return hidden

    def forward(self, scores: torch.Tensor, mask: Optional[torch.Tensor],
                sinks: Optional[torch.Tensor]) -> torch.Tensor:
        logits = scores.float()
        if self.scale is not None:
            logits = logits * self.scale
        hidden = self.hidden(*logits.shape[-2:], logits.device)
        if mask is not None:
            hidden = mask if hidden is None else hidden | mask
        if hidden is not None:
            logits = logits.masked_fill(hidden, float("-inf"))
        if sinks is None:
            return logits.softmax(-1).to(scores.dtype)
        b, heads, sq, _ = logits.shape
        column = sinks.float().view(1, heads, 1, 1).expand(b, heads, sq, 1)
        return torch.cat([logits, column], -1).softmax(-1)[..., :-1].to(scores.dtype)


class SinkDotProductAttention(DotProductAttention):
    """Megatron's local core attention (`DotProductAttention`) with `SinkSoftmax`, and with
    `softmax_type="learnable"`'s sinks built on `torch.cuda.current_device()` only when the
    config does not ask for CPU initialisation (the CPU, or the ambient device such as the
    planner's meta device, otherwise), initialised by the config's `init_method` as Megatron's
    are, and marked tensor-parallel along the heads. Megatron's `sharded_state_dict`
    checkpoints them, split with the heads."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 *args: Any, **kwargs: Any):
        learnable = config.softmax_type == "learnable"
        without_sinks = copy.copy(config)
        without_sinks.softmax_type = "vanilla"
        super().__init__(without_sinks, layer_number, attn_mask_type, *args, **kwargs)
        self.config = config
        if learnable:
            device = None if config.use_cpu_initialization else torch.cuda.current_device()
            self.softmax_offset = torch.nn.Parameter(torch.empty(
                self.num_attention_heads_per_partition, device=device,
                dtype=config.params_dtype))
            # Split with the heads: gradient norms count every rank's share (Megatron's own
            # module leaves the sinks unmarked, so only tensor rank 0's would count).
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: megamoe's local attention "
                             "takes 'vanilla' or 'learnable'")
        megatron = self.scale_mask_softmax  # its layer's window and query-key layer scaling
        self.scale_mask_softmax = SinkSoftmax(attn_mask_type == AttnMaskType.causal,
                                              megatron.window_size, megatron.scale)


def with_sink_attention(layer_spec: ModuleSpec) -> ModuleSpec:
    """Megatron's local GPT layer spec with `SinkDotProductAttention` as its core attention."""
    attention = compat.replace_submodules(layer_spec.submodules.self_attention,
                                          core_attention=SinkDotProductAttention)
    return compat.replace_submodules(layer_spec, self_attention=attention)


def window_settings(window: Optional[int], layers: Optional[list[int]]) -> dict:
    """TransformerConfig's fields for a causal sliding window of `window` tokens (each query
    sees itself and the `window - 1` keys before it, transformers' `sliding_window`) on the
    layers `layers` marks 1 (None: every layer); no window: none."""
    if window is None:
        return {}
    return dict(window_size=(window - 1, 0),
                window_attn_skip_freq=None if layers is None else list(layers))
