"""The `optimizer` section: AdamW or Muon (`megamoe.optim`, AdamW for what Muon does not
take), with linear warm-up and decay to `min_lr`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from megamoe.errors import CheckpointError, ConfigError
from megamoe.optim.muon import check_scale
from megamoe.optim.newton_schulz import DEFAULT_STEPS, JORDAN_COEFFICIENTS, check_newton_schulz
from megamoe.settings import check_fields, unknown_choice

DECAY_STYLES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "muon")


@dataclass
class MuonSettings:
    """`optimizer.muon`: Muon's settings (megamoe.optim.muon; used with `name: muon`)."""

    momentum: float = 0.95
    """Momentum coefficient mu (Moonlight, Jordan et al.: 0.95)."""
    nesterov: bool = True
    """Nesterov momentum (update from G + mu B instead of B)."""
    ns_steps: int = DEFAULT_STEPS
    """Newton-Schulz iterations."""
    ns_coefficients: tuple[float, float, float] = JORDAN_COEFFICIENTS
    """(a, b, c) of the quintic iteration (Jordan et al.'s)."""
    scale: str = "moonlight"
    """Update scaling: `moonlight` (0.2 sqrt(max(rows, cols)): AdamW's update RMS, so Muon
    takes `lr` and `weight_decay` as AdamW does), `jordan` (sqrt(max(1, rows/cols))), `none`."""
    distributed: bool = True
    """Shard the optimizer state by whole parameters over the data-parallel ranks (as
    Megatron-Core's layer-wise distributed optimizer): each rank holds and updates the
    parameters it owns, then broadcasts them (megamoe.train.muon_optimizer). false: every
    data-parallel rank holds the whole state and computes every update."""

    def __post_init__(self) -> None:
        check_fields(self, "optimizer.muon")
        check_newton_schulz(self.ns_steps, tuple(self.ns_coefficients))
        check_scale(self.scale)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optimizer.muon.momentum={self.momentum} must be in [0, 1)")


@dataclass
class OptimizerConfig:
    """AdamW, or Muon for the hidden matrices, with linear warm-up and decay to `min_lr`."""

    name: str = "adamw"
    """`adamw`, or `muon`: Muon for every linear weight and each expert's matrices, AdamW for
    embeddings, output layer, norms, biases, routers and gates (megamoe.optim.params). A resume
    keeps the checkpoint's optimizer; `checkpoint.init_from` may switch it."""
    muon: MuonSettings = field(default_factory=MuonSettings)
    """Muon's settings."""
    qk_clip_threshold: Optional[float] = None
    """MuonClip's QK-clip threshold tau (Kimi-K2, arXiv 2507.20534 sec. 2.1): after each step,
    the query/key projections of every attention head whose max attention logit in the step
    exceeded tau are scaled down to bring it to tau (megamoe.train.qk_clip); the max logit per
    layer is logged. None: off."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to `lr`."""
    decay_style: str = "cosine"
    """`cosine`, `linear` or `constant` after warm-up."""
    decay_steps: Optional[int] = None
    """Steps of decay after warm-up (None: until `train_steps`)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, not applied to biases and 1-D parameters such as norm weights
    (Megatron-Core's parameter groups give them `wd_mult` 0, applied each step as Megatron-LM's
    scheduler does); embeddings and the output layer decay, as in Megatron-Core."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""

    def __post_init__(self) -> None:
        check_fields(self, "optimizer")
        checks = [
            (self.decay_style in DECAY_STYLES,
             f"optimizer.decay_style={self.decay_style!r} is not one of {list(DECAY_STYLES)}"),
            (0 <= self.min_lr <= self.lr,
             f"optimizer.min_lr={self.min_lr} must be in [0, lr={self.lr}]"),
            (self.warmup_steps >= 0, f"optimizer.warmup_steps={self.warmup_steps} must be >= 0"),
            (self.decay_steps is None or self.decay_steps >= 1,
             f"optimizer.decay_steps={self.decay_steps} must be >= 1 or null"),
            (0 <= self.beta1 < 1, f"optimizer.beta1={self.beta1} must be in [0, 1)"),
            (0 <= self.beta2 < 1, f"optimizer.beta2={self.beta2} must be in [0, 1)"),
            (self.eps > 0, f"optimizer.eps={self.eps} must be > 0"),
            (self.weight_decay >= 0, f"optimizer.weight_decay={self.weight_decay} must be >= 0"),
            (self.qk_clip_threshold is None or (math.isfinite(self.qk_clip_threshold)
                                                and self.qk_clip_threshold > 0),
             f"optimizer.qk_clip_threshold={self.qk_clip_threshold} must be a finite number "
             "> 0 or null"),
        ]
        if self.name not in OPTIMIZERS:
            raise unknown_choice("optimizer.name", self.name, OPTIMIZERS)
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def check_resumed_optimizer(saved_config: Any, name: str, path: Any) -> None:
    """Refuse to resume a checkpoint whose run used another optimizer than `name` (its state,
    Adam's moments or Muon's momentum, is not the other's); a checkpoint without the setting
    was trained with AdamW. `checkpoint.init_from` starts a new run from its weights instead."""
    saved = saved_config.get("optimizer") if isinstance(saved_config, dict) else None
    saved_name = saved.get("name", "adamw") if isinstance(saved, dict) else "adamw"
    if saved_name != name:
        raise CheckpointError(
            f"{path} was trained with optimizer.name={saved_name}, this run sets "
            f"optimizer.name={name}: resume with optimizer.name={saved_name}, or start a new run "
            f"(another output_dir) from its weights with checkpoint.init_from={path}")
