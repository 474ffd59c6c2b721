"""Hash routing (Roller et al., Hash Layers for Large Sparse Models, arXiv 2106.04426; the first
MoE layers of DeepSeek-V4): a fixed token-id -> experts table chooses each token's experts,
never an argmax.

The table `tid2eid` [vocab, k] (DeepSeek-V4's name) is a persistent buffer: drawn from
`router.table_seed` when the model is built, then saved and loaded with the checkpoint, so a
release's table loads with its weights. Gates (`router.gates`): `router`, DeepSeek-V4's, the
learned router's scores (its score function, sqrtsoftplus there) gathered at the table's
experts, normalised to sum 1 and scaled by `topk_scaling_factor`; or `equal`, 1/k each, as in
Roller et al. (the router's weights are then unused). The token ids reach the layer beside the
forward (`megamoe.routing.token_ids`). Hash layers balance by their table: no loss-free bias.
Shape legend: T tokens, E experts, K experts per token, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megamoe.config import RouterConfig
from megamoe.errors import ConfigError, DataError
from megamoe.registry import ROUTERS
from megamoe.routing.base import Router, checked_expert_ids, refuse_expert_bias
from megamoe.settings import check_choice, model_setting

GATES = ("router", "equal")


@dataclass
class HashRouterConfig(RouterConfig):
    """The hash router's settings: its table's vocabulary and seed, and its gates."""

    vocab_size: Optional[int] = model_setting(None)
    """Rows of the table, one per token id (the model's vocabulary, padding included)."""

    table_seed: int = model_setting(0)
    """Seed of the table drawn when the model is built: each token id gets k distinct experts
    uniformly at random."""

    gates: str = model_setting("router")
    """`router`: the router's scores at the table's experts, normalised and scaled
    (DeepSeek-V4); `equal`: 1/k each (Roller et al.)."""

    def check_in(self, moe) -> None:
        super().check_in(moe)
        refuse_expert_bias(self, moe)
        check_choice("router.gates", self.gates, GATES)
        if not isinstance(self.vocab_size, int) or self.vocab_size <= 0:
            raise ConfigError(f"router.vocab_size={self.vocab_size!r}: router.kind=hash needs "
                              "the vocabulary its table covers; set it to the model's")
        if moe.balancing.uses_quantile:
            raise ConfigError("balancing.methods=quantile with router.kind=hash: a hash table "
                              "balances by construction; drop 'quantile'")


def draw_table(vocab_size: int, num_experts: int, topk: int, seed: int) -> torch.Tensor:
    """[V, K]: k distinct experts per token id, uniformly at random from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(vocab_size, num_experts, generator=generator).topk(topk, dim=1).indices


@ROUTERS.register("hash", config=HashRouterConfig)
class HashRouter(Router):
    """Each token takes the experts its id has in the table (see the module docstring)."""

    needs_token_ids = True

    def __init__(self, cfg, init_method=None):
        super().__init__(cfg, init_method)
        router = cfg.router
        self.register_buffer("tid2eid", draw_table(router.vocab_size, cfg.num_experts,
                                                   cfg.topk, router.table_seed))
        self.token_ids_T: Optional[torch.Tensor] = None  # set by the layer before each forward

    def select(self, scores_TE, logits_TE, real_T=None):
        ids_T = self.token_ids_T
        if ids_T is None or ids_T.shape[0] != scores_TE.shape[0]:
            raise ConfigError("hash routing: the layer set no token ids for this forward")
        vocab = self.tid2eid.shape[0]
        if ids_T.numel() and (int(ids_T.min()) < 0 or int(ids_T.max()) >= vocab):
            raise DataError(f"hash routing: token id {int(ids_T.max())} (or a negative one) is "
                            f"outside the table's vocabulary of {vocab}; set router.vocab_size "
                            "to the model's")
        chosen_TK = self.tid2eid[ids_T.to(self.tid2eid.device)]
        selected_TE = torch.zeros_like(scores_TE, dtype=torch.bool)
        selected_TE.scatter_(1, chosen_TK, True)
        if self.cfg.router.gates == "equal":
            gates_TE = selected_TE.to(scores_TE.dtype) / self.cfg.topk
        else:
            gates_TE = scores_TE * selected_TE
            gates_TE = gates_TE / (gates_TE.sum(-1, keepdim=True) + 1e-20)
        if self.cfg.router.topk_scaling_factor is not None:
            gates_TE = gates_TE * self.cfg.router.topk_scaling_factor
        return selected_TE, gates_TE

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A loaded table is checked against the layer before it replaces the drawn one."""
        key = prefix + "tid2eid"
        if key in state_dict:
            state_dict[key] = checked_expert_ids(
                state_dict[key], self.tid2eid.shape[0], self.cfg.num_experts, self.cfg.topk,
                "hash routing table", "the layer (router.vocab_size rows, topk columns)",
                "load a table of this model and vocabulary")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
