"""The `guards` section: divergence guards (megamoe.train.guards)."""
from __future__ import annotations

from dataclasses import dataclass

from megamoe.settings import check_choice, check_fields
from megamoe.train.settings.checks import require

SPIKE_ACTIONS = ("stop", "rollback")


@dataclass
class GuardsConfig:
    """Divergence guards, checked every step before the optimizer update (megamoe.train.guards).

    A tripped guard never saves a checkpoint; a run it stops exits with code 3."""

    nonfinite: bool = True
    """Stop at a NaN or Inf loss or gradient norm, naming the step and the first module whose
    output (or parameter, or gradient) went non-finite (as Megatron-LM's
    --check-for-nan-in-loss-and-grad)."""
    spike_factor: float = 10.0
    """A loss above this many times the mean of the last `spike_window` steps is a spike (0:
    off). Checked once the window is full (after `spike_window` steps of this process)."""
    spike_window: int = 50
    """Steps in the loss spike guard's moving average."""
    spike_action: str = "rollback"
    """On a spike: `stop`, or `rollback`: reload the latest checkpoint, replay up to the spike
    and skip the spiking step's batch (PaLM, arXiv 2204.02311 sec. 5.1, skips the batches
    around a spike), at most `max_rollbacks` times."""
    max_rollbacks: int = 3
    """Rollbacks one process may do before a further spike stops the run; the dataset holds
    this many extra steps of samples for the skipped batches."""

    def __post_init__(self) -> None:
        check_fields(self, "guards")
        require(self.spike_factor == 0 or self.spike_factor > 1, "guards.spike_factor="
                f"{self.spike_factor} must be > 1 (or 0 to switch the guard off)")
        require(self.spike_window >= 1, f"guards.spike_window={self.spike_window} must be >= 1")
        check_choice("guards.spike_action", self.spike_action, SPIKE_ACTIONS)
        require(self.max_rollbacks >= 0,
                f"guards.max_rollbacks={self.max_rollbacks} must be >= 0")
