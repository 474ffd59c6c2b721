"""The always-on shared expert (DeepSeekMoE, arXiv 2401.06066), optionally scaled by a sigmoid
gate sigmoid(x . w_gate) as in Qwen2-MoE. Parameter names match Megatron-Core's SharedExpertMLP
(`linear_fc1.weight`, `linear_fc2.weight`, `gate_weight`)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
import torch.nn.functional as F

from megamoe.config import MoEConfig
from megamoe.experts.activations import expert_activation


class SharedExpert(nn.Module):
    def __init__(self, cfg: MoEConfig, init_method: Optional[Callable] = None,
                 output_init_method: Optional[Callable] = None):
        super().__init__()
        size = cfg.shared_expert.ffn_hidden_size
        self.linear_fc1 = nn.Linear(cfg.hidden_size, size * (2 if cfg.experts.gated else 1), bias=False)
        self.linear_fc2 = nn.Linear(size, cfg.hidden_size, bias=False)
        default_init = lambda w: nn.init.normal_(w, 0.0, cfg.init_method_std)  # noqa: E731
        (init_method or default_init)(self.linear_fc1.weight.data)
        (output_init_method or default_init)(self.linear_fc2.weight.data)
        if cfg.shared_expert.gate:
            self.gate_weight = nn.Parameter(torch.empty(1, cfg.hidden_size))
            (init_method or default_init)(self.gate_weight.data)
        else:
            self.gate_weight = None
        self.activation = expert_activation(cfg.experts).forward

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        y_TD = self.linear_fc2(self.activation(self.linear_fc1(x_TD)))
        if self.gate_weight is not None:
            y_TD = y_TD * torch.sigmoid(F.linear(x_TD, self.gate_weight))
        return y_TD
