"""Expert activations. For swiglu, fc1 holds [gate; up] stacked along its output dimension, the
layout Megatron-Core uses (Shazeer, "GLU Variants Improve Transformer", arXiv 2002.05202)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def squared_relu(h: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (So et al., Primer, arXiv 2109.08668)."""
    return F.relu(h).square()


ACTIVATIONS = {"swiglu": swiglu, "gelu": F.gelu, "squared_relu": squared_relu}
