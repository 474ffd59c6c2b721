"""The prompt router of SIMoE and the per-sequence merging coefficients it hands to every layer.

SIMoE (arXiv 2506.12597) merges its experts in parameter space, once per sequence, with
coefficients a_BM read from the prompt; there is no token dispatch. `PromptRouter` computes them
from the mean input embedding of the prompt tokens (the response is not seen, so generation is
causal); `MergeState` carries them from the model's forward to each interpolated module.

Legend: B sequences, S positions, H hidden, M experts.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class MergeState:
    """Holds the current forward's merging coefficients a_BM; set by the model, read by layers."""

    def __init__(self) -> None:
        self.coefficients_BM: Optional[torch.Tensor] = None

    def require(self) -> torch.Tensor:
        if self.coefficients_BM is None:
            raise RuntimeError("SIMoE layers ran without merging coefficients: call the model "
                               "through SIMoEGPT.forward, which routes the prompt first")
        return self.coefficients_BM


class PromptRouter(nn.Module):
    """a_BM = softmax(W_r · mean of the prompt tokens' embeddings)."""

    def __init__(self, hidden_size: int, num_experts: int, init_std: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, hidden_size) * init_std)

    def forward(self, embeddings_BSH: torch.Tensor, prompt_mask_BS: torch.Tensor) -> torch.Tensor:
        weights_BS = prompt_mask_BS.to(embeddings_BSH.dtype)
        counts_B1 = weights_BS.sum(dim=1, keepdim=True).clamp_min(1.0)
        pooled_BH = torch.einsum("bs,bsh->bh", weights_BS, embeddings_BSH) / counts_B1
        return torch.softmax(pooled_BH.float() @ self.weight.float().t(), dim=-1)
