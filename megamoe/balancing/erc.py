"""Expert-router coupling (ERC) loss (Lv et al., arXiv 2512.23447).

Router row w_i is a proxy for the tokens routed to expert i. Perturbed multiplicatively
(x_i = w_i * U(1 - eps, 1 + eps), one draw shared by the whole expert-parallel group) and pushed
through every expert j's input projection, the proxies give an E x E matrix of activation norms
M[i, j] = || W1_j x_i ||. Two hinge losses couple router and experts: proxy i must excite its
own expert more than any other, max(M[i, j] - alpha M[i, i], 0), and expert i must be excited
by its own proxy more than by any other, max(M[j, i] - alpha M[i, i], 0), averaged over the
E (E - 1) pairs j != i (alpha `erc_margin`). The cost, E^2 projections of one vector, does not
depend on the batch size; the loss works with any router.

Expert parallelism: each rank computes the columns of its local experts (differentiable) and
gathers the others' (detached), so every rank holds the same loss. Data-parallel gradient
averaging divides by the data-parallel size, yet each rank holds only its columns' share of
this replicated loss: the local columns carry their gradient times the expert-parallel size,
so the averaged router and expert gradients are exactly those of the loss at EP=1.

Shape legend: E experts, L local experts, D hidden, F fc1 output width.
"""
from __future__ import annotations

import torch

from megamoe.parallel.comm import Comm


def proxy_tokens(router_ED: torch.Tensor, noise: float, comm: Comm) -> torch.Tensor:
    """[E, D]: the router rows, perturbed by multiplicative noise shared over `comm`."""
    factor_ED = torch.empty_like(router_ED, dtype=torch.float32).uniform_(1.0 - noise,
                                                                          1.0 + noise)
    if comm.size > 1:
        factor_ED = comm.all_gather(factor_ED)[0]
    return router_ED * factor_ED.to(router_ED.dtype)


def activation_norms(proxies_ED: torch.Tensor, fc1_LFD: torch.Tensor) -> torch.Tensor:
    """[E, L]: M[i, j] = || W1_j x_i ||_2 for the local experts j."""
    h_LEF = torch.einsum("ed,lfd->lef", proxies_ED.to(fc1_LFD.dtype), fc1_LFD)
    return h_LEF.norm(dim=-1).t()


def coupling_hinges(norms_EE: torch.Tensor, margin: float) -> torch.Tensor:
    """Mean over i != j of max(M[i, j] - a M[i, i], 0) + max(M[j, i] - a M[i, i], 0)."""
    E = norms_EE.shape[0]
    if E < 2:
        return norms_EE.sum() * 0
    diag_E = norms_EE.diagonal()
    off_EE = ~torch.eye(E, dtype=torch.bool, device=norms_EE.device)
    proxy_side = (norms_EE - margin * diag_E.unsqueeze(1)).clamp_min(0.0)   # row i: M[i, j]
    expert_side = (norms_EE - margin * diag_E.unsqueeze(0)).clamp_min(0.0)  # column j: M[i, j]
    return (proxy_side[off_EE].sum() + expert_side[off_EE].sum()) / (E * (E - 1))


def erc_loss(router_ED: torch.Tensor, fc1_LFD: torch.Tensor, noise: float, margin: float,
             comm: Comm) -> torch.Tensor:
    """The ERC loss of one MoE layer whose `comm` rank holds experts [rank L, (rank + 1) L)."""
    local_EL = activation_norms(proxy_tokens(router_ED, noise, comm), fc1_LFD).float()
    if comm.size == 1:
        return coupling_hinges(local_EL, margin)
    columns = comm.all_gather(local_EL.detach())
    columns[comm.rank] = local_EL + (comm.size - 1) * (local_EL - local_EL.detach())
    return coupling_hinges(torch.cat(columns, dim=1), margin)
