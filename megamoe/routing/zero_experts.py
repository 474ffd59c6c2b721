"""Zero-computation experts (LongCat-Flash, arXiv 2509.01322, section 2.1): identity experts
beside the real ones.

The router scores N real experts, then Z identity experts (`experts.zero_experts`), and picks
its top-k among all N + Z. A token's identity choices cost no GEMM, no dispatch and no capacity:
it gets its own hidden state times their summed gates, added to the real experts' output; so a
token routed only to identity experts costs nothing, and the compute per token varies. Their
biases steer the mean number of real experts per token (`megamoe.balancing.budget`).
Shape legend: T tokens, N real experts, E = N + Z router choices.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from megamoe.routing.base import Routing


def split_zero_experts(routing: Routing, num_experts: int
                       ) -> tuple[Routing, Optional[torch.Tensor]]:
    """(the routing of the N real experts, each token's summed identity gate [T, 1]), or
    (`routing`, None) when the router has no zero experts."""
    if routing.selected_TE.shape[1] == num_experts:
        return routing, None
    real = replace(routing, selected_TE=routing.selected_TE[:, :num_experts],
                   routing_map_TE=routing.routing_map_TE[:, :num_experts],
                   gates_TE=routing.gates_TE[:, :num_experts],
                   probs_TE=routing.probs_TE[:, :num_experts],
                   logits_TE=routing.logits_TE[:, :num_experts])
    return real, routing.gates_TE[:, num_experts:].sum(-1, keepdim=True)
