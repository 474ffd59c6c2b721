"""megamoe's balance losses and load metrics in Megatron-Core's MoE logging tracker.

Megatron-LM's `training_log` calls `moe_utils.track_moe_metrics` (core_v0.16) or
`get_moe_metrics_tracker().report(track_names=...)` (main) every iteration: it reduces the
values saved with `save_to_aux_losses_tracker` (per layer, summed over micro-batches), writes
them to the console, TensorBoard and wandb (`moe/<name>_layer_<i>` with
`--moe-per-layer-logging`), scaled by 1/num_microbatches, and zeroes them. The newer tracker
reports only the names it is told to track; `report_load_metrics` adds megamoe's load metrics
to them. megamoe saves under
Megatron's own names, so its losses show where Megatron's would:
`load_balancing_loss`, `seq_load_balancing_loss`, `global_load_balancing_loss`, `z_loss`,
plus `entropy_loss` (top-p routing) and the load metrics `moe_maxvio_batch` (MaxVio of the
micro-batch, arXiv 2408.15664) and `moe_experts_per_token`.

Megatron zeroing the tracker is also the one per-iteration signal a layer can see under
Megatron-LM's loop, which calls no megamoe hook between iterations: `StepClock` notices it (the
tensor's version counter moved without megamoe writing) and the layers then end the last step
and restart their own per-step trackers. Who ends a step is not inferred from it: that is named
when the model is built (`megamoe.balancing.owner`); the clock only says when, and only layers
whose owner ends steps in the forward read it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

from megamoe.balancing.tracker import maxvio
from megamoe.megatron import compat

MEGATRON_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
    "z_loss": "z_loss",
    "entropy_loss": "entropy_loss",
    "adaptive_aux_loss": "adaptive_load_balancing_loss",
    "erc_loss": "erc_loss",
}
CLOCK_NAME = "moe_experts_per_token"  # written by megamoe layers only
LOAD_METRICS = ("moe_maxvio_batch", CLOCK_NAME)


class StepClock:
    """Counts the times something other than megamoe changed the tracker entry CLOCK_NAME (the
    training loop's per-iteration reduce-and-zero)."""

    def __init__(self) -> None:
        self.generation = 0
        self._tensor: Optional[torch.Tensor] = None
        self._version = -1

    def tick(self) -> int:
        """The current generation, advanced if the entry changed behind megamoe's back."""
        values = compat.tracker_entries().get(CLOCK_NAME)
        if self._tensor is not None and (values is not self._tensor or
                                         values._version != self._version):
            self.generation += 1
            self._tensor = None
        return self.generation

    def wrote(self) -> None:
        values = compat.tracker_entries()[CLOCK_NAME]
        self._tensor, self._version = values, values._version


CLOCK = StepClock()


def save_layer_statistics(losses: dict[str, torch.Tensor], selected_TE: torch.Tensor,
                          layer_number: Optional[int], num_layers: int,
                          token_group: Any = None) -> None:
    """Save one micro-batch's unweighted balance losses (this rank's shares, summed over
    `token_group` by Megatron's reduction) and load metrics for Megatron's MoE logging."""
    if layer_number is None:
        return
    entries = compat.tracker_entries()
    for name in [*(MEGATRON_NAMES[n] for n in losses), *LOAD_METRICS]:
        values = entries.get(name)
        if values is not None and values.numel() < num_layers:
            compat.drop_tracker_entry(name)  # left by a model with fewer layers in this process
    for name, value in losses.items():
        save_to_aux_losses_tracker(MEGATRON_NAMES[name], value.detach().float(), layer_number,
                                   num_layers, reduce_group=token_group)
    counts_E = selected_TE.sum(0, dtype=torch.float32)
    tokens = selected_TE.any(-1).sum().clamp_min(1).float()
    save_to_aux_losses_tracker(LOAD_METRICS[0], maxvio(counts_E), layer_number, num_layers)
    save_to_aux_losses_tracker(CLOCK_NAME, counts_E.sum() / tokens, layer_number, num_layers)
    CLOCK.wrote()


def report_load_metrics() -> None:
    """Make Megatron's MoE logging report megamoe's load metrics when it is told which names to
    track (`compat.install_reporting_tracker`). Called on every rank that builds a layer from
    megamoe's specs, so every rank reduces the same names."""
    compat.install_reporting_tracker(LOAD_METRICS)
