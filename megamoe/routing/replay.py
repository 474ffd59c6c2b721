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
    return checked_indices(indices_TK, own_TK.shape[0], experts, own_TK.shape[1],
                           replay.layer_number).to(own_TK.device)


def checked_indices(indices_TK: torch.Tensor, tokens: int, experts: int, topk: int,
                    layer) -> torch.Tensor:
    """`indices_TK` if it is an integer [tokens, topk] tensor of distinct experts < `experts`
    per token; a one-line DataError naming the layer otherwise."""
    where = f"routing replay for MoE layer {layer}"
    if not isinstance(indices_TK, torch.Tensor) or indices_TK.is_floating_point() \
            or indices_TK.shape != (tokens, topk):
        shape = tuple(indices_TK.shape) if isinstance(indices_TK, torch.Tensor) else \
            type(indices_TK).__name__
        raise DataError(f"{where}: indices of shape {shape} where this forward needs integer "
                        f"[{tokens}, {topk}] (its tokens, its top-k); replay a record of this "
                        "model and batch")
    if tokens and (int(indices_TK.min()) < 0 or int(indices_TK.max()) >= experts):
        raise DataError(f"{where}: expert ids from {int(indices_TK.min())} to "
                        f"{int(indices_TK.max())} where the layer has experts 0..{experts - 1}; "
                        "replay a record of this model")
    if topk > 1 and tokens and bool((indices_TK.sort(dim=1).values.diff(dim=1) == 0).any()):
        raise DataError(f"{where}: a token lists the same expert twice; each token's {topk} "
                        "experts must differ")
    return indices_TK.long()
