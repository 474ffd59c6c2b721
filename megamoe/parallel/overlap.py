"""Overlap a computation with the current CUDA stream's work through one side stream per device.

The MoE layer runs its shared expert this way while the routed tokens are dispatched, so the
shared expert's GEMMs hide the dispatch communication (the overlap of computation and
communication of DeepSeek-V3, arXiv 2412.19437; Megatron-Core's `--moe-shared-expert-overlap`).
Autograd runs each backward op on its forward op's stream, so the backward overlaps too. Off
CUDA both functions run inline, so the same code serves CPU.
"""
from __future__ import annotations

from typing import Callable

import torch

_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def start_on_side_stream(fn: Callable[[torch.Tensor], torch.Tensor],
                         x: torch.Tensor) -> torch.Tensor:
    """fn(x), queued on the side stream after the work already queued for x (CUDA), or inline."""
    if x.device.type != "cuda":
        return fn(x)
    if x.device not in _SIDE_STREAMS:
        _SIDE_STREAMS[x.device] = torch.cuda.Stream(device=x.device)
    side = _SIDE_STREAMS[x.device]
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        y = fn(x)
    x.record_stream(side)  # x's memory must outlive the side stream's use of it
    return y


def join_side_stream(y: torch.Tensor) -> torch.Tensor:
    """y, safe to use on the current stream: the current stream waits for the side stream."""
    if y.device.type == "cuda":
        current = torch.cuda.current_stream(y.device)
        current.wait_stream(_SIDE_STREAMS[y.device])
        y.record_stream(current)
    return y
