"""The `evaluation` section: the held-out loss (megamoe.train.evaluate)."""
from __future__ import annotations

from dataclasses import dataclass

from megamoe.settings import check_fields
from megamoe.train.settings.checks import require


@dataclass
class EvaluationConfig:
    """Held-out loss (megamoe.train.evaluate) on the valid split of `data.split`."""

    interval: int = 0
    """Evaluate every this many steps and at the end (metrics `heldout_loss` and each MoE layer's
    routing at inference, `heldout/layer{n}/...`; megamoe.train.evaluate); 0: never. Needs a
    valid split in `data.split` and `parallel.pipeline: 1`."""
    batches: int = 4
    """Global batches of the valid split evaluated each time (the same ones every time)."""

    def __post_init__(self) -> None:
        check_fields(self, "evaluation")
        require(self.interval >= 0,
                f"evaluation.interval={self.interval} must be >= 0 (0: never)")
        require(self.batches >= 1, f"evaluation.batches={self.batches} must be >= 1")
