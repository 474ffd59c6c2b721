"""The collectives megamoe needs, behind one small interface.

`TorchComm` wraps a torch.distributed process group (NCCL or gloo), `SingleComm` is a group of
one, and the tests' `MockComm` (tests/mock_ranks.py) runs N ranks as threads of one process.
Dispatchers and the balancer only see `Comm`, so the same code runs in all three.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from megamoe.errors import MegaMoEError

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class CollectiveError(MegaMoEError):
    """A collective failed on this rank because a peer rank died or stalled past the group's
    timeout (the process group's `timeout`, e.g. `setup_megatron(timeout_s=...)`)."""


class Comm(Protocol):
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In place: `op` ("sum" or "max") of `tensor` over the group."""

    def all_to_all(self, x: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> torch.Tensor:
        """Send rows in_splits[r] of `x` to rank r; return rows received, out_splits[r] from r."""

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on all ranks), in rank order."""


class SingleComm:
    """A group of one rank: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        return None

    def all_to_all(self, x, out_splits, in_splits):
        return x

    def all_gather(self, x):
        return [x]


class TorchComm:
    """Collectives over a torch.distributed process group (None means the default group).

    A collective that fails (gloo and NCCL raise when a peer's connection closes or the group's
    timeout passes) is re-raised as a one-line `CollectiveError` naming the collective and rank.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        with self._failing_clearly("all_reduce"):
            dist.all_reduce(tensor, op=_TORCH_OPS[op], group=self.group)

    def all_to_all(self, x, out_splits, in_splits):
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        with self._failing_clearly("all_to_all"):
            dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(out_splits),
                                   input_split_sizes=list(in_splits), group=self.group)
        return out

    def all_gather(self, x):
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._failing_clearly("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    @contextlib.contextmanager
    def _failing_clearly(self, name: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as err:  # gloo and NCCL failures are RuntimeError subclasses
            cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CollectiveError(
                f"{name} over a group of {self.size} ranks failed on group rank {self.rank} "
                f"(global rank {dist.get_rank()}): a peer rank exited or stalled past the "
                f"process group's timeout; check the other ranks' logs. Cause: {cause}"
            ) from err


def as_comm(group) -> Comm:
    """A Comm for `group`: a Comm passes through, a ProcessGroup is wrapped, None is one rank."""
    if group is None:
        return SingleComm()
    if isinstance(group, dist.ProcessGroup):
        return TorchComm(group)
    return group


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        return comm.all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        grad_in = ctx.comm.all_to_all(grad.contiguous(), ctx.in_splits, ctx.out_splits)
        return grad_in, None, None, None


def all_to_all(comm: Comm, x: torch.Tensor, out_splits: list[int],
               in_splits: list[int]) -> torch.Tensor:
    """Differentiable all-to-all: the backward sends the gradients back the way rows came."""
    if comm.size == 1:
        return x
    return _AllToAll.apply(x, comm, out_splits, in_splits)
