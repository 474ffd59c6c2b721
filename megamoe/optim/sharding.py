"""Which data-parallel rank owns each parameter when optimizer state is sharded by whole
parameters (distributed Muon: `megamoe.train.muon_optimizer`).

Each parameter goes whole to one rank, so the rank can orthogonalise its matrices without
communication; the ranks' loads are balanced by the longest-processing-time rule (Graham,
"Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 1969): largest parameter
first, each to the rank with the fewest elements so far. Megatron-Core's layer-wise
distributed optimizer (`LayerWiseDistributedOptimizer`, for Muon) balances its shards the same
way. The rule depends only on the sizes and their order, so every rank of a data-parallel group
(and every tensor-parallel peer, whose shards have the same sizes) computes the same owners.
"""
from __future__ import annotations


def balanced_owners(sizes: list[int], ranks: int) -> list[int]:
    """The owning rank (0 .. ranks-1) of each of the parameters with these element counts:
    largest first (ties in list order), each to the least-loaded rank (ties: the lowest)."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    loads = [0] * ranks
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners
