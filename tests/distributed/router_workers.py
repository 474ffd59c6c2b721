"""Per-rank job of the multi-process checks of the research routers (run through
`megamoe.parallel.spawn`): the layer cases of `ep_workers` that `ROUTER_CASES` adds, without the
GPT and checkpoint parts, so they run in seconds."""
from __future__ import annotations

import ep_workers

ROUTER_CASES = {
    "sinkhorn": dict(router={"kind": "sinkhorn"}),
    "base_layers": dict(router={"kind": "base"}, topk=1),
    # Expert choice during the warm-up is per forward call, like capacity: a capacity factor
    # that drops nothing makes the reference run each rank's shard.
    "threshold_warmup": dict(router={"kind": "threshold"}, topk=1,
                             shared_expert={"ffn_hidden_size": 12, "gate": True},
                             dispatcher={"capacity_factor": 8.0}),
    "erc_logit_norm": dict(balancing={"erc_loss_coeff": 0.5, "erc_noise": 0.0},
                           router={"gate_logit_norm": 1.0}),
}
ep_workers.LAYER_CASES.update(ROUTER_CASES)


def routers_job(rank: int, world_size: int) -> dict:
    from megamoe.parallel import TorchComm

    pgs = ep_workers._setup(world_size)
    ep_comm, replica_comm = TorchComm(pgs.ep), TorchComm(pgs.tp_dp_cp)
    return {f"{case}/{dispatcher}": ep_workers._layer_case(case, dispatcher, ep_comm,
                                                           replica_comm)
            for case in ROUTER_CASES for dispatcher in ("alltoall", "allgather")}
