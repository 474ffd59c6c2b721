"""The `parallel` section: Megatron-Core parallel sizes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megamoe.settings import check_fields
from megamoe.train.settings.checks import require


@dataclass
class ParallelConfig:
    """Megatron-Core parallel sizes; data parallelism takes the remaining ranks."""

    tensor: int = 1
    """Tensor-parallel size (sequence parallelism is switched on when > 1). Context parallelism
    is not offered: Megatron-Core's local attention refuses it, only Transformer Engine's
    attention implements it."""
    pipeline: int = 1
    """Pipeline-parallel size."""
    virtual_stages: int = 1
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B when > 1; `num_layers` must
    split evenly over pipeline x virtual_stages chunks)."""
    expert: int = 1
    """Expert-parallel size: the experts of each MoE layer are split over this many ranks."""
    first_stage_layers: Optional[int] = None
    """Pipeline: layers of the first stage when `num_layers` does not split evenly (the middle
    stages share the rest equally)."""
    last_stage_layers: Optional[int] = None
    """Pipeline: layers of the last stage (see `first_stage_layers`)."""

    def __post_init__(self) -> None:
        check_fields(self, "parallel")
        for name in ("tensor", "pipeline", "expert", "virtual_stages"):
            require(getattr(self, name) >= 1,
                    f"parallel.{name}={getattr(self, name)} must be >= 1")
        require(self.virtual_stages == 1 or self.pipeline > 1,
                f"parallel.virtual_stages={self.virtual_stages} needs parallel.pipeline > 1")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"parallel.{name}={value} must be >= 1 or null")
