"""Expert activations, each with its derivative for the experts' written-out backward
(`megamoe.experts.grouped`).

For swiglu, fc1 holds [gate; up] stacked along its output dimension, the layout Megatron-Core
uses (Shazeer, "GLU Variants Improve Transformer", arXiv 2002.05202).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from megamoe.registry import ACTIVATIONS


class Activation(NamedTuple):
    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """backward(h, grad_of_output) -> grad_of_h."""


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


ACTIVATIONS.add("swiglu", Activation(swiglu, swiglu_backward))
ACTIVATIONS.add("gelu", Activation(F.gelu, gelu_backward))
ACTIVATIONS.add("squared_relu", Activation(squared_relu, squared_relu_backward))
