"""The `checkpoint` section: Megatron-Core distributed checkpoints (torch_dist)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.settings import check_fields
from megamoe.train.settings.checks import require


@dataclass
class CheckpointConfig:
    """Megatron-Core distributed checkpoints (torch_dist)."""

    interval: int = 0
    """Save every this many steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    dir: Optional[str] = None
    """Checkpoint folder (None: OUTPUT_DIR/checkpoints). A run resumes from the checkpoint its
    `latest_checkpointed_iteration.txt` names."""
    init_from: Optional[str] = None
    """Start a new run from these model weights (e.g. tools/upcycle_ckpt.py output); ignored
    when the run resumes from its own checkpoint."""
    keep_last: int = 2
    """Keep this many newest checkpoints (0: keep all); the newest checkpoint that verified
    before the run started is kept as well."""
    resume_from_verified: bool = False
    """When the tracker's checkpoint is missing or fails its checksums, resume from the newest
    checkpoint that verifies instead of stopping with an error."""
    allow_other_tokenizer: bool = False
    """Train the weights of `init_from` or of the resumed checkpoint on data of a tokenizer
    other than the one the checkpoint records (its fingerprint differs), e.g. after changing
    the vocabulary on purpose. Off, such a run is refused before it trains: the model would
    learn token ids that mean something else."""

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint")
        require(self.interval >= 0,
                f"checkpoint.interval={self.interval} must be >= 0 (0: at the end)")
        require(self.keep_last >= 0,
                f"checkpoint.keep_last={self.keep_last} must be >= 0 (0: keep all)")
