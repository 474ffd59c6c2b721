"""The path of the SLURM launch script the end-to-end tests submit."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRETRAIN_SCRIPT = REPO / "launch" / "pretrain_moe.sh"
