"""Quantile balancing (QB): a per-expert bias solved from the routing scores, with no step size.

Su Jianlin's derivation, used in Kimi K3 and by Megatron-Core 0.19 (`quantile_balancing`):
sending each of N tokens to k of E experts with every expert taking c = N k / E of them is the
assignment problem max sum_ij s_ij x_ij subject to sum_j x_ij = k and sum_i x_ij = c. Its dual
has a variable per token (alpha_i) and one per expert (beta_j), and coordinate descent on it is
two quantiles:
- given beta, alpha_i is the (k+1)-th largest of s_i - beta: the token's experts are the top k
  of s_i - beta (routing with the bias);
- given alpha, beta_j is the (c+1)-th largest of s_ij - alpha_i over the tokens: exactly c
  tokens clear it.
Each training micro-batch routes with the current beta and takes one such sweep; the step's
estimates are averaged over its micro-batches and over the router's replicas, blended into beta
with `balancing.quantile_ema` (0: replaced) and centred to mean 0. s are the router's logits in
fp32 (Megatron-Core's choice), over the whole tensor-parallel group's tokens.

The router keeps beta in its fp32 buffer `qb_beta` (Megatron-Core's name, so checkpoints
interchange); `megamoe.balancing.step_balancing` ends each step, or Megatron-Core's
finalize_model_grads under Megatron-LM's loop (`megamoe.megatron.router_counts`).
Shape legend: T tokens, N the token group's real tokens, E experts, K top-k.
"""
from __future__ import annotations

import torch


def quantile_routing(logits_TE: torch.Tensor, beta_E: torch.Tensor,
                     topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's top-k experts by logit - beta [T, K]; its cutoff alpha, the (k+1)-th
    largest logit - beta [T, 1])."""
    best = (logits_TE - beta_E).topk(topk + 1, dim=1)
    return best.indices[:, :-1], best.values[:, -1:]


def expert_quantile(shifted_NE: torch.Tensor, topk: int) -> torch.Tensor:
    """beta [E] given alpha: per expert, the (c+1)-th largest of logit - alpha over the N
    tokens, c = N k / E (rounded down when it is not whole, e.g. with padding)."""
    tokens, experts = shifted_NE.shape
    per_expert = tokens * topk // experts
    return shifted_NE.topk(per_expert + 1, dim=0).values[-1]


def next_beta(beta_E: torch.Tensor, estimate_E: torch.Tensor, ema: float) -> torch.Tensor:
    """ema * beta + (1 - ema) * estimate, centred to mean 0."""
    blended = ema * beta_E + (1.0 - ema) * estimate_E
    return blended - blended.mean()
