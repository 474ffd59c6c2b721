"""Once per optimizer step: reduce routing counts over the replica group, update the loss-free
balancing biases, and report per-layer load metrics.

Loss-free balancing (Wang et al., arXiv 2408.15664; DeepSeek-V3): c_i = tokens that chose expert
i, summed over every rank holding a replica of the router (data, context, tensor and
expert-parallel ranks); b_i += u * sign(mean(c) - c_i). Each router is reduced and updated on its
own, so layers may differ in expert count, top-k or router type. The same reduction carries the
routers' own per-step state (`Router.step_sums`/`end_step`: the expert thresholds of
`megamoe.routing.threshold`) and drives Skywork-MoE's adaptive aux-loss coefficient
(`megamoe.balancing.adaptive`).

Metrics: `maxvio_global` is MaxVio over one optimizer step's global batch (all replicas and
micro-batches), `maxvio_batch` the mean over this rank's micro-batches. The paper's own
MaxVio_global counts a whole evaluation set; a run approximates it by pooling the per-step
`load` fractions over many steps (`tools/study_routing.py` pools the last 50).
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import nn

from megamoe.balancing.adaptive import drop_rate, update_coefficient
from megamoe.balancing.tracker import LoadTracker, maxvio
from megamoe.parallel.comm import Comm, SingleComm

_SUMS = 5  # tokens, experts-per-token sum, micro-batch MaxVio sum, micro-batches, max-gate sum


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
    """The router's own per-step state to sum (empty for routers without any)."""
    own = router.step_sums() if hasattr(router, "step_sums") else None
    return torch.zeros(0, device=device) if own is None else own.to(device, torch.float32)


def _packed_state(router: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(values to SUM, values to MAX) of one router's tracker and own state; zeros if it saw
    no tokens. SUM layout: selected [E], routed [E], _SUMS scalars, router state, losses."""
    load, E = router.load, router.cfg.num_experts
    loss_names = sorted(load.loss_sums)
    own = _router_sums(router, device)
    if load.empty:
        sums = torch.cat([torch.zeros(2 * E + _SUMS, device=device), own,
                          torch.zeros(len(loss_names), device=device)])
        maxes = torch.tensor([0.0, -float(E + 1)], device=device)
        return sums, maxes
    losses = [load.loss_sums[name].reshape(1) for name in loss_names]
    sums = torch.cat([load.selected_E, load.routed_E, load.sums, own, *losses])
    maxes = torch.stack([load.experts_per_token_max, -load.experts_per_token_min])
    return sums, maxes


def step_balancing(models: Union[nn.Module, Iterable[nn.Module]],
                   replica_comm: Optional[Comm] = None) -> dict[str, object]:
    """Finish one optimizer step's balancing: all-reduce the counts of every router over
    `replica_comm`, apply the bias update where balancing='bias', reset the trackers and return
    metrics keyed `moe/layer{n}/...` (floats, plus `load` as a per-expert list of fractions).

    Call it after the backward passes of all micro-batches, on every rank of the replica group.
    Every rank applies the same update to the same reduced counts, so biases stay identical.
    When a host framework updated the biases itself (Megatron's finalize_model_grads, see
    `Router.bias_updated_by_host`), it only reports the step's metrics and resets the trackers
    (it never updates a bias twice).
    """
    comm = replica_comm or SingleComm()
    routers = routers_of(models)
    if not routers:
        return {}
    device = routers[0].weight.device
    own_sizes = [_router_sums(r, device).numel() for r in routers]
    packed = [_packed_state(r, device) for r in routers]
    sums = torch.cat([s for s, _ in packed])
    maxes = torch.cat([m for _, m in packed])
    comm.all_reduce(sums, op="sum")
    comm.all_reduce(maxes, op="max")
    metrics: dict[str, object] = {}
    offset = 0
    for index, (router, (router_sums, _)) in enumerate(zip(routers, packed)):
        chunk = sums[offset:offset + router_sums.numel()]
        offset += router_sums.numel()
        layer_maxes = maxes[2 * index:2 * index + 2]
        name = f"moe/layer{router.layer_number if router.layer_number is not None else index}"
        own_size = own_sizes[index]
        start = 2 * router.cfg.num_experts + _SUMS
        own_summed, chunk = chunk[start:start + own_size], torch.cat(
            [chunk[:start], chunk[start + own_size:]])
        metrics.update(_layer_metrics(router, chunk, layer_maxes, name))
        if router.training:
            _end_step(router, chunk, own_summed if own_size else None, metrics, name)
        bias_E = router.bias_E
        if bias_E is not None and router.training and not router.bias_updated_by_host:
            with torch.no_grad():
                bias_E += bias_update(chunk[:router.cfg.num_experts], router.cfg.bias_update_rate,
                                      router.cfg.bias_mean_centering)
            router.after_bias_update()
        router.load.reset()
    return metrics


def _end_step(router: nn.Module, chunk: torch.Tensor, own_summed: Optional[torch.Tensor],
              metrics: dict, name: str) -> None:
    """The router's per-step updates besides the bias: its own state (thresholds) and the
    adaptive aux-loss coefficient, from the step's reduced counts."""
    if hasattr(router, "end_step"):
        router.end_step(own_summed)
    coeff = getattr(router, "adaptive_aux_coeff", None)
    if coeff is not None and float(chunk[2 * router.cfg.num_experts]) > 0:
        E, cfg = router.cfg.num_experts, router.cfg
        rate = drop_rate(chunk[:E], chunk[E:2 * E], cfg.capacity_factor)
        update_coefficient(coeff, rate, cfg.adaptive_aux_decay, cfg.adaptive_aux_sensitivity)
        metrics[f"{name}/adaptive_aux_coeff"] = float(coeff[0])
        metrics[f"{name}/adaptive_drop_rate"] = float(rate)


def _layer_metrics(router: nn.Module, chunk: torch.Tensor, layer_maxes: torch.Tensor,
                   name: str) -> dict[str, object]:
    E = router.cfg.num_experts
    selected_E, routed_E = chunk[:E], chunk[E:2 * E]
    tokens, ept_sum, maxvio_sum, microbatches, max_gate_sum = chunk[2 * E:2 * E + _SUMS].tolist()
    if tokens == 0:
        return {}
    loss_values = chunk[2 * E + _SUMS:].tolist()
    total = max(float(selected_E.sum()), 1.0)
    out: dict[str, object] = {
        f"{name}/maxvio_global": float(maxvio(selected_E)),
        f"{name}/maxvio_batch": maxvio_sum / microbatches,
        f"{name}/cv": float(selected_E.std(unbiased=False) / selected_E.mean().clamp_min(1e-9)),
        f"{name}/experts_per_token": ept_sum / tokens,
        f"{name}/experts_per_token_max": float(layer_maxes[0]),
        f"{name}/experts_per_token_min": float(-layer_maxes[1]),
        f"{name}/dropped_fraction": 1.0 - float(routed_E.sum()) / total,
        f"{name}/mean_max_gate": max_gate_sum / tokens,
        f"{name}/load": (selected_E / total).tolist(),
    }
    for loss_name, value in zip(sorted(router.load.loss_sums), loss_values):
        out[f"{name}/{loss_name}"] = value / microbatches
    return out
