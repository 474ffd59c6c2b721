"""SIMoE at inference: deterministic masks, one merge per sequence, then a dense model's cost.

SIMoE (arXiv 2506.12597) merges its experts in parameter space with the router's coefficients
for the sequence; the merged model is a plain dense model. `merged_dense_state_dict` writes that
dense model's weights (Megatron GPTModel names, loadable into the seed's architecture), and
`inference_parameters` counts what serving needs, next to a sparse-upcycled MoE's.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.simoe.model import SIMoEGPTModel, is_simoe_state


@torch.no_grad()
def merged_dense_state_dict(model: SIMoEGPTModel, coefficients_M: torch.Tensor) -> dict:
    """The dense weights W0 + (a · z) * Delta for one sequence's coefficients a [M]."""
    state = {name: value for name, value in model.state_dict().items()
             if not is_simoe_state(name)}
    for name, module in model.named_modules():
        if not hasattr(module, "mask_logits"):
            continue
        gates_MI = module.gated.gates(module.mask_logits, training=False)
        scales_I = coefficients_M.to(module.delta_weight) @ gates_MI.to(module.delta_weight)
        state[f"{name}.weight"] = module.weight + scales_I * module.delta_weight
    return state


def count(params) -> int:
    return sum(p.numel() for p in params)


def inference_parameters(model: SIMoEGPTModel) -> dict[str, int]:
    """Parameters SIMoE serves with: `active` per sequence (the merged dense model) and `stored`
    (seed, delta, masks and router, from which each sequence's merge is made)."""
    stored = count(model.parameters())
    merge_inputs = count(p for n, p in model.named_parameters() if is_simoe_state(n))
    return {"active": stored - merge_inputs, "stored": stored}


def moe_inference_parameters(model: nn.Module, num_experts: int, topk: int) -> dict[str, int]:
    """The same two counts for a token-choice MoE whose expert weights hold `experts` in their
    name: `active` counts top-k of the experts per token."""
    expert = count(p for n, p in model.named_parameters() if ".experts." in n)
    total = count(model.parameters())
    return {"active": total - expert + expert * topk // num_experts, "stored": total}
