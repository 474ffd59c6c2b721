"""The largest model megamoe builds, checked when a config loads.

A size beyond these fails late and badly: the trainer allocates its tensors (a layer override
of `num_experts: 1e9` asked for 512 GB at model build), and the memory planner builds every
pipeline stage on the meta device, where a tensor of 2^63 elements or more overflows and every
routed expert's weights are initialised on their own (about 0.1 ms each on one core). The bounds
keep every tensor of a build far below 2^63 elements (the largest product, experts x expert FFN
x hidden, below 2^58) and one build at most `MAX_EXPERT_WEIGHTS` routed experts; each is far
above any published model (DeepSeek-V3: 61 layers, hidden 7168, 256 experts, 58 x 256 expert
weights).
"""
from __future__ import annotations

from typing import Any

from megamoe.config import moe_layer_pattern
from megamoe.errors import ConfigError
from megamoe.settings import flat_values

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
"""The largest value of each size."""
MAX_EXPERT_WEIGHTS = 2**18
"""Routed experts initialised by one build: MoE layers x experts, summed over the layers."""


def _moe_settings(moe: Any) -> list[tuple[str, dict]]:
    """(setting prefix, {dotted setting: value}) of the base `moe` section and of each layer
    override."""
    section = {name: value for name, value in moe.to_dict().items()
               if name != "layer_overrides"}
    return [("moe", flat_values(section)),
            *((f"moe.layer_overrides.{layer}", flat_values(changes))
              for layer, changes in moe.layer_overrides.items())]


def _sizes(sections: dict[str, Any]) -> list[tuple[str, str, object]]:
    """(limit name, setting as the user writes it, value) of every bounded size present."""
    found = []
    for name in MAX_SIZE:
        section, field = name.split(".", 1)
        if section == "moe":
            found += [(name, f"{prefix}.{field}", values[field])
                      for prefix, values in _moe_settings(sections["moe"]) if field in values]
        else:
            found.append((name, name, getattr(sections[section], field)))
    return found


def check_model_size(model: Any, moe: Any, data: Any, training: Any) -> None:
    """A one-line ConfigError for a size beyond `MAX_SIZE`, a layer override's included, or a
    model whose build would initialise more than `MAX_EXPERT_WEIGHTS` routed experts (the
    config's `model`, `moe`, `data` and `training` sections)."""
    sections = {"model": model, "moe": moe, "data": data, "training": training}
    for name, setting, value in _sizes(sections):
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SIZE[name]:
            raise ConfigError(f"{setting}={value} is beyond the largest model megamoe builds "
                              f"(at most {MAX_SIZE[name]:,}); choose a smaller size")
    pattern = moe_layer_pattern(model, model.first_k_dense)
    experts = sum(moe.layer(layer).num_experts for layer, is_moe in enumerate(pattern) if is_moe)
    if experts > MAX_EXPERT_WEIGHTS:
        raise ConfigError(f"moe.num_experts: {experts:,} routed experts over the MoE layers are "
                          f"beyond the largest model megamoe builds (at most "
                          f"{MAX_EXPERT_WEIGHTS:,}, each initialised on its own); use fewer "
                          "experts or layers")
