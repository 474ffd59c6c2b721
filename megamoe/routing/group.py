"""The router logits of a whole expert-parallel group, for routers that solve one assignment
over all of the group's tokens (Sinkhorn, BASE): every rank gathers the same matrix, solves the
same problem and keeps its own rows, so routing is identical at EP=1 and EP=N. Quantile
balancing gathers over the tensor-parallel group the same way, for its quantiles.

Shape legend: T this rank's tokens, N the group's real tokens, E experts.
"""
from __future__ import annotations

from typing import Optional

import torch

from megamoe.parallel.comm import Comm


def gather_group_logits(comm: Comm, logits_TE: torch.Tensor,
                        real_T: Optional[torch.Tensor]) -> tuple[torch.Tensor, slice]:
    """(the group's real-token logits [N, E] in rank order, detached; the rows of this rank's
    real tokens in it). Ranks may hold different token counts."""
    logits_TE = logits_TE.detach()
    own_NE = logits_TE if real_T is None else logits_TE[real_T]
    if comm.size == 1:
        return own_NE, slice(0, own_NE.shape[0])
    counts = comm.all_gather(torch.tensor([own_NE.shape[0]], device=logits_TE.device))
    counts = [int(c) for c in counts]
    padded_NE = own_NE.new_zeros((max(counts), own_NE.shape[1]))
    padded_NE[:own_NE.shape[0]] = own_NE
    parts = comm.all_gather(padded_NE)
    start = sum(counts[:comm.rank])
    return torch.cat([p[:c] for p, c in zip(parts, counts)]), slice(start, start + counts[comm.rank])


def scatter_rows(rows_NX: torch.Tensor, real_T: Optional[torch.Tensor], fill) -> torch.Tensor:
    """[T, ...]: this rank's real-token rows back at their token positions, `fill` elsewhere."""
    if real_T is None:
        return rows_NX
    out = rows_NX.new_full((real_T.shape[0],) + tuple(rows_NX.shape[1:]), fill)
    out[real_T] = rows_NX
    return out
