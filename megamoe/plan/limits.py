"""What the planner can count, checked before it builds anything.

The planner builds each pipeline stage of the real model on the meta device (`shards`): every
tensor has its true shape, so a size beyond what torch indexes (numel below 2^63) overflows,
and every routed expert's weights are initialised on their own (about 0.1 ms each on one core),
so a million experts in each of a few layers would run for many minutes. The settings below are
bounded so that every tensor of a build stays far below 2^63 elements (the largest product,
experts x expert FFN x hidden, below 2^58) and one build initialises at most
`MAX_EXPERT_WEIGHTS` expert weights (well under a minute); each bound is far above any
published model (DeepSeek-V3: 61 layers, hidden 7168, 256 experts, 58 x 256 expert weights).
"""
from __future__ import annotations

import math
import re
from typing import Optional

from megamoe.config import moe_layer_pattern
from megamoe.errors import ConfigError
from megamoe.settings import flat_values
from megamoe.train.config import TrainConfig

MAX_SIZE = {
    "model.num_layers": 2**10,
    "model.hidden_size": 2**20,
    "model.ffn_hidden_size": 2**22,
    "model.seq_length": 2**24,
    "model.num_attention_heads": 2**14,
    "model.num_query_groups": 2**14,
    "model.kv_channels": 2**16,
    "model.q_lora_rank": 2**20,
    "model.kv_lora_rank": 2**20,
    "model.qk_head_dim": 2**16,
    "model.qk_pos_emb_head_dim": 2**16,
    "model.v_head_dim": 2**16,
    "data.vocab_size": 2**24,
    "training.micro_batch_size": 2**12,
    "moe.num_experts": 2**16,
    "moe.ffn_hidden_size": 2**22,
    "moe.shared_expert.ffn_hidden_size": 2**22,
}
"""The largest value of each size the planner counts."""
MAX_EXPERT_WEIGHTS = 2**18
"""Routed experts initialised by one build: MoE layers x experts, summed over the layers."""


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
MAX_WORLD = 1 << 20


def parse_memory(text: str) -> float:
    """'80GiB', '80GB', '141e9', '0.5TiB' -> bytes (G, GiB: 2^30; GB: 10^9)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or not math.isfinite(float(match.group(1))) \
            or float(match.group(1)) <= 0:
        raise ConfigError(f"--device-memory {text!r} is not a size; write e.g. 80GiB, 141GB "
                          "or 80e9 (bytes)")
    return float(match.group(1)) * _UNITS[unit]


def check_world(world: Optional[int], flag: str) -> None:
    if world is not None and not 1 <= world <= MAX_WORLD:
        raise ConfigError(f"{flag} {world} must be a number of ranks in 1..{MAX_WORLD:,}")


def check_maxvio(maxvio: float) -> None:
    if not (math.isfinite(maxvio) and maxvio >= 0):
        raise ConfigError(f"--maxvio {maxvio} must be >= 0 (0: perfectly balanced experts)")


def check_request(world: Optional[int], ranks: Optional[int], maxvio: float,
                  measure: bool) -> None:
    """The planner's arguments besides the config (--world, --ranks, --maxvio, --measure):
    one-line ConfigError unless it can plan them."""
    check_world(world, "--world")
    check_world(ranks, "--ranks")
    check_maxvio(maxvio)
    if measure and world is not None:
        raise ConfigError("--measure runs the config's own layout; drop --world (or --measure)")


def _moe_settings(config: TrainConfig) -> list[tuple[str, dict]]:
    """(setting prefix, {dotted setting: value}) of the base `moe` section and of each layer
    override."""
    section = {name: value for name, value in config.moe.to_dict().items()
               if name != "layer_overrides"}
    return [("moe", flat_values(section)),
            *((f"moe.layer_overrides.{layer}", flat_values(changes))
              for layer, changes in config.moe.layer_overrides.items())]


def _sizes(config: TrainConfig) -> list[tuple[str, str, object]]:
    """(limit name, setting as the user writes it, value) of every bounded size present."""
    found = []
    for name in MAX_SIZE:
        section, field = name.split(".", 1)
        if section == "moe":
            found += [(name, f"{prefix}.{field}", values[field])
                      for prefix, values in _moe_settings(config) if field in values]
        else:
            found.append((name, name, getattr(getattr(config, section), field)))
    return found


def _experts(config: TrainConfig, layer: int) -> int:
    return config.moe.layer(layer).num_experts


def check_countable(config: TrainConfig) -> None:
    """A one-line ConfigError, before any build, for a size beyond `MAX_SIZE` or a model
    whose builds would initialise more than `MAX_EXPERT_WEIGHTS` routed experts."""
    for name, setting, value in _sizes(config):
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SIZE[name]:
            raise ConfigError(f"{setting}={value} is beyond what the memory planner counts "
                              f"(at most {MAX_SIZE[name]:,}); plan a smaller model")
    pattern = moe_layer_pattern(config.model, config.model.first_k_dense)
    experts = sum(_experts(config, layer) for layer, moe in enumerate(pattern) if moe)
    if experts > MAX_EXPERT_WEIGHTS:
        raise ConfigError(f"moe.num_experts: {experts:,} routed experts over the MoE layers are "
                          f"beyond what the memory planner builds (at most "
                          f"{MAX_EXPERT_WEIGHTS:,}, each initialised on its own); plan fewer "
                          "experts or layers")
