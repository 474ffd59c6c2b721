"""The attention masks megamoe passes Megatron-Core's GPTModel (CPU and CUDA)."""
from __future__ import annotations

from typing import Optional

import torch


def causal_attention_mask(seq_len: int) -> torch.Tensor:
    """Boolean causal mask of shape [1, 1, seq_len, seq_len]; True marks a masked-out position.

    This is the form Megatron's local attention takes (it broadcasts over batch and heads).
    Passing it avoids `attention_mask=None`, for which Megatron builds the mask on CUDA.
    """
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)
    return future.view(1, 1, seq_len, seq_len)


def attention_mask_for(seq_len: int, on_cuda: bool) -> Optional[torch.Tensor]:
    """The mask to pass a GPTModel: None on CUDA, where Megatron's attention builds its own causal
    mask, and `causal_attention_mask` on the CPU."""
    return None if on_cuda else causal_attention_mask(seq_len)
