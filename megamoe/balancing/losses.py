"""Balance losses, all computed from the routing that was actually used (bias and group limits
included), over the tokens that were routed (padded tokens excluded).

Shape legend: T tokens, E experts, S sequence length, B micro-batch size (T = S * B, s-major).

Tensor (sequence) parallelism splits one micro-batch's tokens over a token group whose ranks
then SUM the router's gradients (Megatron-Core's `finalize_model_grads` for parameters marked
`sequence_parallel`). Each loss here is therefore this rank's share of the loss over the whole
token group: sums over the local tokens divided by the group's token count (`num_tokens`), with
the assignment counts reduced over the group by the caller. Summed over the group it is exactly
the loss a single rank would compute on all of the micro-batch's tokens; with a group of one it
is the plain mean.
"""
from __future__ import annotations

import torch


def per_token_distribution(probs_TE: torch.Tensor) -> torch.Tensor:
    """The router distribution P per token: softmax as is, sigmoid or sqrtsoftplus scores
    normalised to sum 1."""
    return probs_TE / probs_TE.sum(-1, keepdim=True).clamp_min(1e-20)


def real_tokens(selected_TE: torch.Tensor) -> torch.Tensor:
    """Bool [T]: tokens routed to at least one expert (padded tokens are routed to none)."""
    return selected_TE.any(-1)


def switch_aux_loss(probs_TE: torch.Tensor, selected_TE: torch.Tensor, counts_E: torch.Tensor,
                    num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Switch Transformer balance loss E * sum_i f_i * P_i (Fedus et al., arXiv 2101.03961).

    f_i = counts_E / counts_E.sum(): the fraction of assignments that went to expert i, over the
    token group (micro-batch loss), or over every replica of the router (global loss). P_i is
    the router probability of expert i summed over this rank's routed tokens and divided by
    `num_tokens`, the routed tokens of the token group (default: this rank's).
    """
    real_T = real_tokens(selected_TE)
    if num_tokens is None:
        num_tokens = real_T.sum()
    prob_sum_E = per_token_distribution(probs_TE)[real_T].sum(0)
    fraction_E = counts_E / counts_E.sum().clamp_min(1.0)
    return probs_TE.shape[-1] * (fraction_E.detach() * prob_sum_E).sum() / _at_least_one(num_tokens)


def sequence_counts(selected_TE: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
    """[B, E + 1]: per sequence of this rank's tokens, assignments per expert and routed tokens
    (reduce it over the token group for `sequence_aux_loss`)."""
    selected_BSE = selected_TE.view(seq_len, batch, -1).transpose(0, 1).to(torch.float32)
    counts_BE = selected_BSE.sum(1)
    tokens_B1 = selected_BSE.amax(-1).sum(1, keepdim=True)
    return torch.cat([counts_BE, tokens_B1], dim=1)


def sequence_aux_loss(probs_TE: torch.Tensor, selected_TE: torch.Tensor, seq_len: int,
                      batch: int, group_counts_BE1: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-level balance loss (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3, arXiv
    2412.19437): the Switch loss computed per sequence and averaged over the micro-batch's
    sequences. `group_counts_BE1` is `sequence_counts` summed over the token group (default:
    this rank's), so a sequence split over tensor-parallel ranks is balanced as a whole."""
    E = probs_TE.shape[-1]
    if group_counts_BE1 is None:
        group_counts_BE1 = sequence_counts(selected_TE, seq_len, batch)
    counts_BE, tokens_B = group_counts_BE1[:, :E], group_counts_BE1[:, E]
    probs_BSE = per_token_distribution(probs_TE).view(seq_len, batch, E).transpose(0, 1)
    real_BS1 = real_tokens(selected_TE).view(seq_len, batch).t().unsqueeze(-1)
    prob_sum_BE = (probs_BSE * real_BS1).sum(1)
    fraction_BE = counts_BE / counts_BE.sum(-1, keepdim=True).clamp_min(1.0)
    per_sequence_B = E * (fraction_BE.detach() * prob_sum_BE).sum(-1) / tokens_B.clamp_min(1.0)
    return per_sequence_B.mean()


def z_loss(logits_TE: torch.Tensor, selected_TE: torch.Tensor,
           num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Router z-loss mean(logsumexp(logits)^2) (ST-MoE, Zoph et al., arXiv 2202.08906), as this
    rank's share over `num_tokens` routed tokens of the token group (default: this rank's)."""
    real_T = real_tokens(selected_TE)
    if num_tokens is None:
        num_tokens = real_T.sum()
    return torch.logsumexp(logits_TE[real_T], dim=-1).square().sum() / _at_least_one(num_tokens)


def entropy_loss(probs_TE: torch.Tensor, selected_TE: torch.Tensor,
                 num_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """Mean entropy of the router distribution, the "dynamic loss" of top-p routing (Huang et al.,
    ACL 2024, arXiv 2403.07652): minimising it stops the router from flattening P to activate
    more experts. This rank's share over `num_tokens` routed tokens of the token group."""
    real_T = real_tokens(selected_TE)
    if num_tokens is None:
        num_tokens = real_T.sum()
    p_TE = per_token_distribution(probs_TE)[real_T]
    return -(p_TE * torch.log(p_TE.clamp_min(1e-20))).sum() / _at_least_one(num_tokens)


def _at_least_one(num_tokens):
    return num_tokens.clamp_min(1.0) if torch.is_tensor(num_tokens) else max(float(num_tokens), 1.0)


class AttachLoss(torch.autograd.Function):
    """`attach_loss(output, loss, scale)`: returns `output` unchanged, and in the backward pass
    gives `loss` the gradient `scale`, so the loss trains the parameters it depends on as if
    `scale * loss` were added to the objective while the forward value (and the reported LM
    loss) stays the same."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


attach_loss = AttachLoss.apply
