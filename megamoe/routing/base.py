"""The router interface: logits -> `Routing`, shared by every routing method.

Shape legend: T tokens, D hidden size, E experts.
A router never assumes a fixed number of experts per token: its selection is a boolean map
`selected_TE` whose row sums may vary (dynamic top-p), with gate weights `gates_TE` that are zero
off the map.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from megamoe.balancing.tracker import LoadTracker
from megamoe.config import MoEConfig


@dataclass(frozen=True)
class Routing:
    """What a router decided for one batch of tokens.

    selected_TE: experts chosen by the router (bias and group limits applied), bool.
    routing_map_TE: experts the tokens are actually sent to (selected minus capacity drops).
    gates_TE: weights that multiply each expert's output, zero off `routing_map_TE`.
    probs_TE: the router's distribution over experts (softmax, or sigmoid normalised per token),
        the P of the balance losses.
    logits_TE: raw router logits (z-loss).
    """

    selected_TE: torch.Tensor
    routing_map_TE: torch.Tensor
    gates_TE: torch.Tensor
    probs_TE: torch.Tensor
    logits_TE: torch.Tensor

    def with_map(self, routing_map_TE: torch.Tensor) -> "Routing":
        """The same routing with a smaller dispatch map (gates zeroed off it)."""
        return replace(self, routing_map_TE=routing_map_TE,
                       gates_TE=self.gates_TE * routing_map_TE)


def in_recomputation() -> bool:
    """True while autograd's backward is running, i.e. during activation recomputation."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """Linear router with an optional loss-free balancing bias.

    Subclasses implement `select(scores_TE, logits_TE) -> (selected_TE, gates_TE)`, where
    `scores_TE` are the router probabilities. The expert bias (arXiv 2408.15664) lives in the fp32
    buffer `expert_bias`; it steers selection only and is updated by
    `megamoe.balancing.step_balancing`, never by gradients.
    """

    def __init__(self, cfg: MoEConfig, init_method=None):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        (init_method or _normal_init(cfg.init_method_std))(self.weight)
        if cfg.balancing == "bias":
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.load = LoadTracker(cfg.num_experts)
        self.layer_number: Optional[int] = None

    def forward(self, x_TD: torch.Tensor, padding_mask_T: Optional[torch.Tensor] = None) -> Routing:
        """Route tokens; padded tokens (padding_mask_T True) go to no expert and are not counted."""
        dtype = self.cfg.torch_router_dtype
        logits_TE = F.linear(x_TD.to(dtype), self.weight.to(dtype))
        probs_TE = self.probabilities(logits_TE)
        selected_TE, gates_TE = self.select(probs_TE, logits_TE)
        if padding_mask_T is not None:
            keep_T1 = ~padding_mask_T.reshape(-1, 1)
            selected_TE = selected_TE & keep_T1
            gates_TE = gates_TE * keep_T1
        return Routing(selected_TE, selected_TE, gates_TE, probs_TE, logits_TE)

    def probabilities(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """Softmax over experts, or sigmoid scores (normalised per token for the balance loss)."""
        if self.cfg.score_function == "softmax":
            return torch.softmax(logits_TE, dim=-1)
        return torch.sigmoid(logits_TE)

    def selection_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Scores that decide selection: the router scores plus the balancing bias, if any."""
        if self.expert_bias is None:
            return scores_TE.detach()
        return scores_TE.detach() + self.expert_bias.to(scores_TE.dtype)

    def select(self, scores_TE: torch.Tensor, logits_TE: torch.Tensor):
        raise NotImplementedError

    def record(self, routing: Routing, losses: dict[str, torch.Tensor]) -> None:
        """Count this routing and its (unweighted) balance losses for balancing and metrics, if
        it is a kept training forward (not eval, not activation recomputation)."""
        if self.training and not in_recomputation():
            self.load.record(routing.selected_TE, routing.routing_map_TE)
            self.load.record_losses(losses)

    @property
    def local_tokens_per_expert(self) -> torch.Tensor:
        """This step's selection counts under the name Megatron-Core's `finalize_model_grads`
        reads (and zeroes in place) when `moe_router_enable_expert_bias` drives the bias update
        from Megatron-LM's training loop instead of `step_balancing`."""
        if self.load.empty:
            return self.weight.new_zeros(self.cfg.num_experts, dtype=torch.float32)
        return self.load.selected_E

    def _apply(self, fn, recurse=True):
        """Move the expert bias with the module but keep it in fp32 (a bf16 cast would erase
        updates of size 1e-3)."""
        bias = self.expert_bias
        if bias is None:
            return super()._apply(fn, recurse)
        self._buffers["expert_bias"] = None
        try:
            super()._apply(fn, recurse)
        finally:
            moved_device = fn(bias[:0]).device
            self._buffers["expert_bias"] = bias.to(device=moved_device, dtype=torch.float32)
        return self


def _normal_init(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)
