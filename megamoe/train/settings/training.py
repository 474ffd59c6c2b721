"""The `training` section: steps, batch sizes, precision, device, recomputation, routing
records."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megamoe.settings import check_choice, check_fields
from megamoe.train.settings.checks import require

PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
RECOMPUTE = ("none", "full", "selective")
# Megatron-Core's selective recompute modules that apply to megamoe's GPT (no Megatron MoE
# layers): `mlp` recomputes dense MLPs and megamoe's MoE layers, `moe` the latter, `mla_up_proj`
# multi-head latent attention's up projections and RoPE.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "mla_up_proj")


@dataclass
class TrainingConfig:
    """Steps, batch sizes, precision, device."""

    train_steps: int = 100
    """Optimizer steps of the whole run (a resumed run continues up to this count)."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all data-parallel ranks (gradient accumulation makes up
    the rest)."""
    seed: int = 1234
    """Seed of weight initialisation, dropout and data order."""
    precision: str = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `fp32` or `bf16`."""
    device: str = "auto"
    """`auto` (CUDA when available), `cpu` or `cuda`."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    recompute: str = "none"
    """Activation recomputation: `none`, `full` (every transformer layer) or `selective` (the
    `recompute_modules` of each layer)."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn", "mlp"])
    """With `recompute: selective`, Megatron-Core's recompute modules (`core_attn`,
    `layernorm`, `mlp`: dense MLPs and megamoe MoE layers, `moe`: megamoe MoE layers only,
    `mla_up_proj`: MLA's up projections and RoPE, which needs model.multi_latent_attention)."""
    exit_interval: int = 0
    """Save and exit 0 whenever the step count is a multiple of this (0: never), so a long run
    proceeds in chunks (a rerun of the same command resumes); as Megatron-LM's --exit-interval."""
    collective_timeout_s: float = 600.0
    """A collective waiting longer than this (a dead rank) fails instead of hanging."""
    stop_grace_s: float = 120.0
    """After a stop signal (SIGTERM, SIGUSR1, SIGINT), a rank that has not reached the end of
    its step within this many seconds exits at once, with code 128 + the signal and no new
    checkpoint (the last one stays); the save after the step it reaches is not cut short. 0: wait
    for the step however long it takes. launch/pretrain_moe.sh signals 120 s before the time
    limit."""

    routing_record: Optional[str] = None
    """Write every step's routing (each MoE layer's top-k experts of every token) under this
    folder, one file per micro-batch and pipeline stage (`megamoe.train.routing_records`); needs
    moe.router.replay."""
    routing_replay: Optional[str] = None
    """Train with the routing of a record in this folder (routing replay, R3: an inference
    engine's choices, say) instead of the routers' own; needs moe.router.replay."""

    def __post_init__(self) -> None:
        check_fields(self, "training")
        for name in ("train_steps", "micro_batch_size", "global_batch_size"):
            require(getattr(self, name) >= 1,
                    f"training.{name}={getattr(self, name)} must be >= 1")
        check_choice("training.precision", self.precision, PRECISIONS)
        check_choice("training.device", self.device, DEVICES)
        check_choice("training.recompute", self.recompute, RECOMPUTE)
        unknown = sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES))
        require(not unknown, f"training.recompute_modules has {unknown}; choose from "
                f"{list(RECOMPUTE_MODULES)}")
        require(self.global_batch_size % self.micro_batch_size == 0,
                f"training.global_batch_size={self.global_batch_size} is not a multiple of "
                f"training.micro_batch_size={self.micro_batch_size}")
        require(self.grad_clip >= 0,
                f"training.grad_clip={self.grad_clip} must be >= 0 (0 disables)")
        require(self.exit_interval >= 0,
                f"training.exit_interval={self.exit_interval} must be >= 0")
        require(self.seed >= 0, f"training.seed={self.seed} must be >= 0")
        require(self.collective_timeout_s > 0,
                f"training.collective_timeout_s={self.collective_timeout_s} must be > 0")
        require(self.stop_grace_s >= 0,
                f"training.stop_grace_s={self.stop_grace_s} must be >= 0 (0: no limit)")
        require(not (self.routing_record and self.routing_replay),
                f"training.routing_record={self.routing_record} with training.routing_replay="
                f"{self.routing_replay}: a run records its routing or replays a record, not "
                "both; drop one")
