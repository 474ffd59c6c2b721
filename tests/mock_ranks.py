"""An in-process mock of N expert-parallel ranks.

Each rank runs in its own thread with a `MockComm`; collectives meet at a barrier and exchange
tensors through shared slots, so the dispatcher runs exactly the code path, split sizes and
exchange order of a real multi-process all-to-all. Autograd runs CPU backward work on the thread
that calls `backward`, so each rank's backward also meets the others in the reverse all-to-alls.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_TIMEOUT_S = 120.0


class MockWorld:
    """Shared state of N mock ranks."""

    def __init__(self, size: int, timeout_s: float = _TIMEOUT_S):
        self.size = size
        self.timeout_s = timeout_s
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank deposits `value`; each gets the list of all ranks' values."""
        self.slots[rank] = value
        self.barrier.wait(self.timeout_s)
        values = list(self.slots)
        self.barrier.wait(self.timeout_s)
        return values


class MockComm:
    """The Comm of one mock rank."""

    def __init__(self, world: MockWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        values = self.world.exchange(self.rank, tensor.clone())
        reduce = torch.add if op == "sum" else torch.maximum
        result = values[0]
        for value in values[1:]:
            result = reduce(result, value)
        tensor.copy_(result)

    def all_to_all(self, x, out_splits, in_splits):
        chunks = self.world.exchange(self.rank, x.detach().split(list(in_splits)))
        received = [chunks[src][self.rank] for src in range(self.size)]
        assert [r.shape[0] for r in received] == list(out_splits), "all_to_all split mismatch"
        return torch.cat(received).clone()

    def all_gather(self, x):
        return [v.clone() for v in self.world.exchange(self.rank, x.detach())]


def run_ranks(size: int, fn: Callable[[MockComm], Any], timeout_s: float = _TIMEOUT_S) -> list[Any]:
    """Run fn(comm) on `size` mock ranks in parallel threads; return results in rank order.

    An exception on any rank breaks the barrier for the others and is re-raised here.
    """
    world = MockWorld(size, timeout_s)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            results[rank] = fn(MockComm(world, rank))
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            errors.append(err)
            world.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    real_errors = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real_errors or errors:
        raise (real_errors or errors)[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"mock expert-parallel ranks did not finish within {timeout_s}s")
    return results


def expert_parallel_replica(layer, ep_comm, replica_comm=None):
    """A copy of a single-process MoELayer for one rank of `ep_comm`: the router and shared
    expert copied, and only this rank's slice of the stacked expert weights. `replica_comm`
    (default: `ep_comm`) is the group the router is replicated over. The copy's parameters are
    fresh leaves, so gradients can be compared with the original's."""
    from megamoe.layer import MoELayer

    replica = MoELayer(layer.cfg, ep_comm=ep_comm, replica_comm=replica_comm or ep_comm)
    E = layer.cfg.num_experts
    mine = slice(ep_comm.rank * (E // ep_comm.size), (ep_comm.rank + 1) * (E // ep_comm.size))
    # Expert tensors hold one expert after another on their first axis (flat for biases).
    state = {name: (value.reshape(E, -1)[mine].reshape(-1, *value.shape[1:])
                    if name.startswith("experts.") else value)
             for name, value in layer.state_dict().items()}
    replica.load_state_dict(state)
    replica.train(layer.training)
    return replica
