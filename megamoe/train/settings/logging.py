"""The `logging` section: console, JSONL, TensorBoard and wandb metrics."""
from __future__ import annotations

from dataclasses import dataclass

from megamoe.settings import check_fields
from megamoe.train.settings.checks import require


@dataclass
class LoggingConfig:
    """Console, JSONL, TensorBoard and wandb metrics."""

    interval: int = 10
    """Print and log every this many steps (the JSONL file gets every step)."""
    tensorboard: bool = True
    """Write TensorBoard events to OUTPUT_DIR/tensorboard (when tensorboard is installed)."""
    wandb: bool = False
    """Log to Weights & Biases: online with WANDB_API_KEY set, else offline into OUTPUT_DIR."""
    wandb_project: str = "megamoe"
    """wandb project name."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        check_fields(self, "logging")
        require(self.interval >= 1, f"logging.interval={self.interval} must be >= 1")
