"""BASE layers: balanced assignment of tokens to experts (Lewis et al. 2021, arXiv 2103.16716).

Training: each of the N real tokens of the expert-parallel group (`megamoe.routing.group`) goes
to exactly one expert, every expert takes N / E of them (the first N mod E experts one more),
and the sum of the chosen logits is maximal: a linear assignment problem, solved exactly (the
paper uses an auction algorithm; scipy's `linear_sum_assignment` over the experts' slots
here). Inference: greedy top-1. The layer's output takes BASE's form
sigmoid(h . w_e) * f_e(h) + (1 - sigmoid(h . w_e)) * h, with h the MoE layer's input; a token
that capacity drops gets h.

Shape legend: T tokens, N the group's real tokens, E experts, D hidden.
"""
from __future__ import annotations

import torch

from megamoe.errors import ConfigError
from megamoe.routing.base import Router, Routing
from megamoe.routing.group import gather_group_logits, scatter_rows


@torch.no_grad()
def balanced_assignment(logits_NE: torch.Tensor) -> torch.Tensor:
    """[N] expert of each token maximising the summed logits with equal expert loads."""
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError as err:  # a declared dependency; only a broken install lacks it
        raise ConfigError("router_type='base' needs scipy (pip install scipy)") from err
    N, E = logits_NE.shape
    if N == 0:
        return torch.zeros(0, dtype=torch.long, device=logits_NE.device)
    slots_E = torch.full((E,), N // E, dtype=torch.long)
    slots_E[:N % E] += 1
    slot_expert_N = torch.repeat_interleave(torch.arange(E), slots_E)
    cost_NN = -logits_NE.to(torch.float64).cpu()[:, slot_expert_N]
    rows, slots = linear_sum_assignment(cost_NN.numpy())
    expert_N = torch.empty(N, dtype=torch.long)
    expert_N[torch.as_tensor(rows)] = slot_expert_N[torch.as_tensor(slots)]
    return expert_N.to(logits_NE.device)


class BaseLayersRouter(Router):
    """Balanced linear assignment in training, greedy top-1 at inference; sigmoid gates."""

    def select(self, scores_TE, logits_TE, real_T=None):
        if self.training:
            group_NE, own = gather_group_logits(self.group_comm, logits_TE, real_T)
            expert_T = scatter_rows(balanced_assignment(group_NE)[own], real_T, 0)
        else:
            expert_T = logits_TE.detach().argmax(-1)
        selected_TE = torch.zeros_like(logits_TE, dtype=torch.bool)
        selected_TE.scatter_(1, expert_T.unsqueeze(1), True)
        if real_T is not None:
            selected_TE &= real_T.unsqueeze(1)
        return selected_TE, scores_TE * selected_TE

    def mix_output(self, x_TD: torch.Tensor, y_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """sigma * f_e(h) + (1 - sigma) * h: `y_TD` already holds sigma * f_e(h); tokens routed
        to no expert by capacity keep h, padding tokens get 0."""
        chosen_T = routing.selected_TE.any(-1, keepdim=True)
        keep_T1 = (1.0 - routing.gates_TE.sum(-1, keepdim=True)) * chosen_T
        return y_TD + keep_T1.to(x_TD.dtype) * x_TD
