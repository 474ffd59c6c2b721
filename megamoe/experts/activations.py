"""Expert activations, each with its derivative for the experts' written-out backward
(`megamoe.experts.grouped`).

For the GLUs (swiglu, clamped_swiglu), fc1 holds [gate; up] stacked along its output
dimension, the layout Megatron-Core uses (Shazeer, "GLU Variants Improve Transformer", arXiv
2002.05202).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from megamoe.registry import ACTIVATIONS


class Activation(NamedTuple):
    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """backward(h, grad_of_output) -> grad_of_h."""
    configured: Optional[Callable[[Any], "Activation"]] = None
    """For an activation with settings: configured(experts settings) -> the activation with
    them (`expert_activation`); the registered entry has their defaults."""


def expert_activation(experts: Any) -> Activation:
    """The activation an `ExpertsConfig` names, with its settings."""
    entry = ACTIVATIONS[experts.activation]
    return entry if entry.configured is None else entry.configured(experts)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Both halves written straight into one gradient buffer (no concatenation)."""
    gate, up = h.chunk(2, dim=-1)
    grad_h = torch.empty_like(h)
    grad_gate, grad_up = grad_h.chunk(2, dim=-1)
    torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
    torch.mul(grad, F.silu(gate), out=grad_up)
    return grad_h


def gelu_backward(h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad, h)


def squared_relu(h: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (So et al., Primer, arXiv 2109.08668)."""
    return F.relu(h).square()


def squared_relu_backward(h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return grad * 2 * F.relu(h)


QUICK_GELU_ALPHA = 1.702
"""The sigmoid gain of GPT-OSS's GLU, Megatron-Core's `quick_gelu` (x sigmoid(1.702 x), the
GELU approximation of Hendrycks and Gimpel, arXiv 1606.08415)."""


def clamped_swiglu(limit: float) -> Activation:
    """GPT-OSS's clamped SwiGLU (OpenAI gpt-oss model card, arXiv 2508.10925; transformers'
    `GptOssExperts`, Megatron-Core's quick_gelu GLU with `glu_linear_offset` 1 and
    `activation_func_clamp_value`): over h = [gate; up],
    g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) * g * sigmoid(1.702 g).
    A clamped input has zero gradient (a value on the limit passes it, as torch.clamp does)."""

    def forward(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(QUICK_GELU_ALPHA * gate)

    def backward(h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """d out / d g = (u + 1) (s + 1.702 g s (1 - s)), s = sigmoid(1.702 g);
        d out / d u = g s; each masked where its clamp was active."""
        gate, up = h.chunk(2, dim=-1)
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        s = torch.sigmoid(QUICK_GELU_ALPHA * g)
        grad_h = torch.empty_like(h)
        grad_gate, grad_up = grad_h.chunk(2, dim=-1)
        d_glu = s * (1 + QUICK_GELU_ALPHA * g * (1 - s))
        torch.mul(grad * (u + 1) * d_glu, gate <= limit, out=grad_gate)
        torch.mul(grad * g * s, (up >= -limit) & (up <= limit), out=grad_up)
        return grad_h

    return Activation(forward, backward,
                      configured=lambda experts: clamped_swiglu(experts.swiglu_limit))


ACTIVATIONS.add("swiglu", Activation(swiglu, swiglu_backward))
ACTIVATIONS.add("clamped_swiglu", clamped_swiglu(7.0))
ACTIVATIONS.add("gelu", Activation(F.gelu, gelu_backward))
ACTIVATIONS.add("squared_relu", Activation(squared_relu, squared_relu_backward))
