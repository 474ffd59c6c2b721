"""Routing replay (R3, Ma et al., arXiv 2510.11370): train with the experts another forward
chose, for example the inference engine that generated an RL rollout, whose routers disagree
with the trainer's on about 10% of choices.

A top-k router built with `router.replay` (Megatron's `moe_enable_routing_replay`) holds one of
Megatron-Core's own `RouterReplay` objects, made by the host adapter with the router
(`megamoe.megatron.moe_module.MegatronMoELayer.make_replay`; this module reads it by its
attributes and its action's value, without importing Megatron), so it registers in
`RouterReplay.global_router_replay_instances` in layer order as Megatron's `TopKRouter` does, and
the RL frameworks that drive Megatron-Core (verl, slime, NeMo-RL) drive megamoe's layers
unchanged: `RouterReplay.set_global_router_replay_action(RECORD)` keeps each layer's top-k
indices [T, K] of the last forward (`get_recorded_data()`); `set_replay_data([...])` then
`REPLAY_FORWARD` makes every router take the given experts, and `REPLAY_BACKWARD` takes them,
first in first out, for the forwards that activation recomputation replays. The gates are the
router's own scores gathered at the replayed experts (normalised and scaled as top-k gates
are), as Megatron-Core gathers them. megamoe also replays in recomputation under
`REPLAY_FORWARD` (first in first out), and records only kept forwards, so a 1F1B pipeline
schedule, whose forwards and recomputations interleave, replays each micro-batch's own experts.

`megamoe.train` writes and reads such records per step (`training.routing_record`,
`training.routing_replay`; `megamoe.train.routing_records`).
Shape legend: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import torch

from megamoe.errors import DataError
from megamoe.routing.base import checked_expert_ids

# Megatron-Core's RouterReplayAction values.
RECORD, REPLAY_FORWARD, REPLAY_BACKWARD = "record", "replay_forward", "replay_backward"


def replayed_topk(replay, own_TK: torch.Tensor, experts: int,
                  in_recomputation: bool) -> torch.Tensor:
    """The top-k indices [T, K] a router uses under `replay`'s action: its own choice `own_TK`
    (recorded under RECORD, in a kept forward), or the replayed indices, checked to fit."""
    action = getattr(replay.router_replay_action, "value", None)
    if action == RECORD:
        if not in_recomputation:
            replay.record_indices(own_TK)
        return own_TK
    if action == REPLAY_BACKWARD or (action == REPLAY_FORWARD and in_recomputation):
        if not replay.replay_backward_list:
            raise DataError("routing replay: a recomputed forward found no replayed indices "
                            "left; set the replay data once per micro-batch (set_replay_data)")
        indices_TK = replay.replay_backward_list.pop(0)
    elif action == REPLAY_FORWARD:
        indices_TK = replay.target_topk_idx
        if indices_TK is None:
            raise DataError("routing replay: REPLAY_FORWARD without replay data; call "
                            "RouterReplay.set_replay_data with one [tokens, topk] tensor per "
                            "MoE layer first")
    else:
        return own_TK
    return checked_replay_indices(indices_TK, own_TK.shape[0], experts, own_TK.shape[1],
                                  replay.layer_number).to(own_TK.device)


def checked_replay_indices(indices_TK, tokens: int, experts: int, topk: int,
                           layer) -> torch.Tensor:
    """Replayed indices that fit a forward of `tokens` tokens (`checked_expert_ids`)."""
    return checked_expert_ids(indices_TK, tokens, experts, topk,
                              f"routing replay for MoE layer {layer}: indices", "this forward",
                              "replay a record of this model and batch")
