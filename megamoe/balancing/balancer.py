"""Once per optimizer step: reduce routing counts over the replica group, update the loss-free
balancing biases, and report per-layer load metrics.

Loss-free balancing (Wang et al., arXiv 2408.15664; DeepSeek-V3): c_i = tokens that chose expert
i, summed over every rank holding a replica of the router (data, context, tensor and
expert-parallel ranks); b_i += u * sign(mean(c) - c_i). Each router is reduced and updated on its
own, so layers may differ in expert count, top-k or router type. The same reduction carries the
routers' own per-step state (`Router.step_sums`/`end_step`: the expert thresholds of
`megamoe.routing.threshold`), averages quantile balancing's estimates over the step's
micro-batches and the replicas into its bias (`megamoe.balancing.quantile`) and drives
Skywork-MoE's adaptive aux-loss coefficient (`megamoe.balancing.adaptive`).

Metrics: `maxvio_global` is MaxVio over one optimizer step's global batch (all replicas and
micro-batches), `maxvio_batch` the mean over this rank's micro-batches. With zero-computation
experts, loads and `experts_per_token` count the real experts, `zero_experts_per_token` the
identity ones. The paper's own
MaxVio_global counts a whole evaluation set; a run approximates it by pooling the per-step
`load` fractions over many steps (`tools/study_routing.py` pools the last 50).
"""
from __future__ import annotations

import warnings
from typing import Iterable, Optional, Union

import torch
from torch import nn

from megamoe.balancing.adaptive import drop_rate, update_coefficient
from megamoe.balancing.budget import budget_update
from megamoe.balancing.quantile import next_beta
from megamoe.balancing.tracker import LoadTracker, StepStatistics, maxvio
from megamoe.parallel.comm import Comm, SingleComm


def bias_update(counts_E: torch.Tensor, rate: float, mean_centering: bool) -> torch.Tensor:
    """The loss-free balancing step u * sign(mean(c) - c), optionally centred to mean 0."""
    step_E = rate * torch.sign(counts_E.mean() - counts_E)
    if mean_centering:
        step_E = step_E - step_E.mean()
    return step_E


def routers_of(models: Union[nn.Module, Iterable[nn.Module]]) -> list[nn.Module]:
    """Every megamoe router (a module owning a LoadTracker) in a model or model chunks."""
    if isinstance(models, nn.Module):
        models = [models]
    return [m for model in models for m in model.modules()
            if isinstance(getattr(m, "load", None), LoadTracker)]


def _router_sums(router: nn.Module, device: torch.device) -> torch.Tensor:
    """The router's own per-step state to sum, then its quantile estimate averaged over the
    step's micro-batches, a 1 that counts the replicas and its number of micro-batches (empty
    for routers without any)."""
    own = router.step_sums() if hasattr(router, "step_sums") else None
    parts = [torch.zeros(0, device=device) if own is None else own.to(device, torch.float32)]
    if router.quantile_beta_E is not None:
        batches = router.quantile_batches.to(device, torch.float32).reshape(1)
        parts += [router.quantile_sum / batches.clamp_min(1), torch.ones(1, device=device),
                  batches]
    return torch.cat(parts)


def step_balancing(models: Union[nn.Module, Iterable[nn.Module]],
                   replica_comm: Optional[Comm] = None,
                   step: Optional[int] = None) -> dict[str, object]:
    """Finish one optimizer step's balancing: all-reduce the statistics of every router over
    `replica_comm`, apply the bias update where balancing uses `bias` or `quantile`, reset the
    trackers and return metrics keyed `moe/layer{n}/...` (floats, plus `load` as a per-expert
    list of fractions).

    Call it after the backward passes of all micro-batches, on every rank of the replica group.
    Every rank applies the same update to the same reduced counts, so biases stay identical.
    `step`: the optimizer step being taken, whose rate of `balancing.bias_update_schedule` the
    bias moves by (None: `balancing.bias_update_rate`). A router whose step owner leaves the bias
    to Megatron's finalize_model_grads (`megamoe.balancing.owner`) gets its other updates and
    metrics here, never a second bias update; but if finalize_model_grads did not take this
    step's counts (a loop of one's own that never calls it), the bias is updated here, with a
    one-time warning naming the step owner that says so.
    """
    comm = replica_comm or SingleComm()
    routers = routers_of(models)
    if not routers:
        return {}
    device = routers[0].weight.device
    stats = [router.load.stats or StepStatistics.none(router.cfg.num_experts, device)
             for router in routers]
    packed = [(*s.pack(), _router_sums(r, device)) for r, s in zip(routers, stats)]
    sums = torch.cat([part for sums, _, own in packed for part in (sums, own)])
    untaken = torch.tensor([float(_counts_left_by_finalize(r)) for r in routers], device=device)
    maxes = torch.cat([m for _, m, _ in packed] + [untaken])
    comm.all_reduce(sums, op="sum")
    comm.all_reduce(maxes, op="max")
    untaken = maxes[2 * len(routers):] > 0
    metrics: dict[str, object] = {}
    offset = 0
    for index, (router, own_stats, (router_sums, _, own)) in enumerate(
            zip(routers, stats, packed)):
        reduced = StepStatistics.unpack(sums[offset:offset + router_sums.numel()],
                                        maxes[2 * index:2 * index + 2], router.cfg.num_experts,
                                        list(own_stats.losses))
        offset += router_sums.numel()
        own_summed = sums[offset:offset + own.numel()]
        offset += own.numel()
        quantile_summed = None
        if router.quantile_beta_E is not None:
            split = own_summed.numel() - router.cfg.num_experts - 2
            own_summed, quantile_summed = own_summed[:split], own_summed[split:]
        name = f"moe/layer{router.layer_number if router.layer_number is not None else index}"
        metrics.update(_layer_metrics(reduced, name))
        if router.cfg.experts.zero_experts and f"{name}/experts_per_token" in metrics:
            # Real experts are counted above; the rest of each token's top-k is identity.
            metrics[f"{name}/zero_experts_per_token"] = (
                router.cfg.topk - metrics[f"{name}/experts_per_token"])
        if router.training:
            _end_step(router, reduced, own_summed if own_summed.numel() else None, metrics,
                      name)
        by_us = router.step_owner.bias_by_step_balancing or bool(untaken[index])
        if router.training and by_us:
            _update_biases(router, reduced, quantile_summed, step)
            if untaken[index]:
                _take_counts_from_finalize(router)
        router.load.reset()
        router.reset_quantile_estimates()
    return metrics


@torch.no_grad()
def _update_biases(router: nn.Module, reduced: StepStatistics,
                   quantile_summed: Optional[torch.Tensor], step: Optional[int]) -> None:
    """The step's loss-free bias update from the reduced counts, and quantile balancing's from
    the replicas' estimates (their sum, the number of replicas, of micro-batches), as
    Megatron-Core averages them: every replica weighs the same."""
    cfg = router.cfg
    balancing = cfg.balancing
    if router.bias_E is not None:
        rate = (balancing.bias_update_rate if step is None
                else balancing.bias_update_rate_at(step))
        if cfg.experts.zero_experts:  # the real experts' biases, towards the compute budget
            router.bias_E[:cfg.num_experts].add_(budget_update(
                reduced.selected_E, reduced.tokens, cfg.real_experts_per_token, rate))
        else:
            router.bias_E.add_(bias_update(reduced.selected_E, rate,
                                           balancing.bias_mean_centering))
    if quantile_summed is not None and float(quantile_summed[-1]) > 0:
        estimate_E = quantile_summed[:-2] / quantile_summed[-2]
        beta_E = router.quantile_beta_E
        beta_E.copy_(next_beta(beta_E, estimate_E, balancing.quantile_ema))


def _counts_left_by_finalize(router: nn.Module) -> bool:
    """Whether the router's bias belongs to Megatron's finalize_model_grads, which has not
    taken this step's counts (it zeroes `local_tokens_per_expert`, and quantile balancing's
    estimates, when it updates the bias)."""
    if router.step_owner.bias_by_step_balancing or not router.training:
        return False
    counts = getattr(router, "local_tokens_per_expert", None)
    if counts is not None and bool(counts.sum() > 0):
        return True
    return router.quantile_beta_E is not None and int(router.quantile_batches) > 0


_WARNED: set[str] = set()


def _take_counts_from_finalize(router: nn.Module) -> None:
    """Zero the counts finalize_model_grads would have taken, saying once per process why the
    bias moved here."""
    if "local_tokens_per_expert" in router._buffers:
        router.local_tokens_per_expert.zero_()
    if "finalize" not in _WARNED:
        _WARNED.add("finalize")
        warnings.warn("step_balancing updated expert biases that the layers leave to Megatron's "
                      "finalize_model_grads (built with moe_router_enable_expert_bias=True or "
                      "quantile_balancing), "
                      "which did not run this step; a loop that calls step_balancing builds its "
                      "layers with step_owner=StepOwner.STEP_BALANCING", stacklevel=3)


def _end_step(router: nn.Module, reduced: StepStatistics, own_summed: Optional[torch.Tensor],
              metrics: dict, name: str) -> None:
    """The router's per-step updates besides the bias: its own state (thresholds) and the
    adaptive aux-loss coefficient, from the step's reduced statistics."""
    if hasattr(router, "end_step"):
        router.end_step(own_summed)
    coeff = getattr(router, "adaptive_aux_coeff", None)
    if coeff is not None and float(reduced.tokens) > 0:
        cfg = router.cfg
        rate = drop_rate(reduced.selected_E, reduced.routed_E, cfg.dispatcher.capacity_factor)
        update_coefficient(coeff, rate, cfg.balancing.adaptive_aux_decay,
                           cfg.balancing.adaptive_aux_sensitivity)
        metrics[f"{name}/adaptive_aux_coeff"] = float(coeff[0])
        metrics[f"{name}/adaptive_drop_rate"] = float(rate)


def _layer_metrics(reduced: StepStatistics, name: str) -> dict[str, object]:
    tokens = float(reduced.tokens)
    if tokens == 0:
        return {}
    selected_E, microbatches = reduced.selected_E, float(reduced.microbatches)
    total = max(float(selected_E.sum()), 1.0)
    out: dict[str, object] = {
        f"{name}/maxvio_global": float(maxvio(selected_E)),
        f"{name}/maxvio_batch": float(reduced.maxvio_sum) / microbatches,
        f"{name}/cv": float(selected_E.std(unbiased=False) / selected_E.mean().clamp_min(1e-9)),
        f"{name}/experts_per_token": float(reduced.experts_per_token_sum) / tokens,
        f"{name}/experts_per_token_max": float(reduced.experts_per_token_max),
        f"{name}/experts_per_token_min": float(reduced.experts_per_token_min),
        f"{name}/dropped_fraction": 1.0 - float(reduced.routed_E.sum()) / total,
        f"{name}/mean_max_gate": float(reduced.max_gate_sum) / tokens,
        f"{name}/load": (selected_E / total).tolist(),
    }
    for loss_name, value in reduced.losses.items():
        out[f"{name}/{loss_name}"] = float(value) / microbatches
    return out
