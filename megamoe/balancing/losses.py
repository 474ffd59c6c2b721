"""Balance losses, all computed from the routing that was actually used (bias and group limits
included), over the tokens that were routed (padded tokens excluded).

Shape legend: T tokens, E experts, S sequence length, B micro-batch size (T = S * B, s-major).
"""
from __future__ import annotations

import torch


def _per_token_distribution(probs_TE: torch.Tensor) -> torch.Tensor:
    """The router distribution P per token: softmax as is, sigmoid scores normalised to sum 1."""
    return probs_TE / probs_TE.sum(-1, keepdim=True).clamp_min(1e-20)


def switch_aux_loss(probs_TE: torch.Tensor, selected_TE: torch.Tensor,
                    counts_E: torch.Tensor) -> torch.Tensor:
    """Switch Transformer balance loss E * sum_i f_i * P_i (Fedus et al., arXiv 2101.03961).

    f_i = counts_E / counts_E.sum() is the fraction of assignments that went to expert i; pass
    counts summed over the replica group for the global (whole-batch) loss. P_i is the mean router
    probability of expert i over this rank's routed tokens; averaging the loss over ranks with
    equal token counts gives exactly the single-process loss.
    """
    real_T = selected_TE.any(-1)
    mean_prob_E = _per_token_distribution(probs_TE)[real_T].mean(0)
    fraction_E = counts_E / counts_E.sum().clamp_min(1.0)
    return probs_TE.shape[-1] * (fraction_E.detach() * mean_prob_E).sum()


def sequence_aux_loss(probs_TE: torch.Tensor, selected_TE: torch.Tensor,
                      seq_len: int, batch: int) -> torch.Tensor:
    """Sequence-level balance loss (DeepSeek-V2, arXiv 2405.04434): the Switch loss computed per
    sequence and averaged over the sequences of the micro-batch."""
    E = probs_TE.shape[-1]
    probs_BSE = _per_token_distribution(probs_TE).view(seq_len, batch, E).transpose(0, 1)
    selected_BSE = selected_TE.view(seq_len, batch, E).transpose(0, 1).to(probs_TE.dtype)
    real_BS1 = selected_BSE.amax(-1, keepdim=True)
    mean_prob_BE = (probs_BSE * real_BS1).sum(1) / real_BS1.sum(1).clamp_min(1.0)
    counts_BE = selected_BSE.sum(1)
    fraction_BE = counts_BE / counts_BE.sum(-1, keepdim=True).clamp_min(1.0)
    return E * (fraction_BE * mean_prob_BE).sum(-1).mean()


def z_loss(logits_TE: torch.Tensor, selected_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss mean(logsumexp(logits)^2) (ST-MoE, Zoph et al., arXiv 2202.08906)."""
    real_T = selected_TE.any(-1)
    return torch.logsumexp(logits_TE[real_T], dim=-1).square().mean()


def entropy_loss(probs_TE: torch.Tensor, selected_TE: torch.Tensor) -> torch.Tensor:
    """Mean entropy of the router distribution, the "dynamic loss" of top-p routing (Huang et al.,
    ACL 2024, arXiv 2403.07652): minimising it stops the router from flattening P to activate
    more experts."""
    real_T = selected_TE.any(-1)
    p_TE = _per_token_distribution(probs_TE)[real_T]
    return -(p_TE * torch.log(p_TE.clamp_min(1e-20))).sum(-1).mean()
