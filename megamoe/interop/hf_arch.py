"""A Hugging Face dense decoder's `config.json` (Llama, Mistral, Qwen2, Qwen3), as megamoe model
settings.

`read_hf_arch(dir)` checks that the model is one megamoe can reproduce exactly and returns its
architecture; `HFArch.model_settings()` is the `model` section of a megamoe training config that
builds the same network on Megatron-Core (RoPE with the model's base and Llama 3 scaling,
RMSNorm with its epsilon, SwiGLU, grouped-query attention, Qwen2's QKV bias, Qwen3's per-head
QK norm, tied or untied output layer). Both the legacy (`rope_theta`, `rope_scaling`) and the
transformers 5 (`rope_parameters`) spellings of the rotary settings are read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megamoe.errors import CheckpointError

CONFIG_FILE = "config.json"
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe",
             "dbrx", "jamba", "granitemoe", "phimoe")
MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
# Megatron-Core's `rope_scaling` is Llama 3.1's rule with these constants.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class HFArch:
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rope_scaling_factor: Optional[float]
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int

    def model_settings(self) -> dict[str, Any]:
        """The megamoe training config's `model` section for this network."""
        return dict(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_key_value_heads, ffn_hidden_size=self.intermediate_size,
            normalization="RMSNorm", position_embedding="rope",
            rotary_base=int(self.rope_theta), rope_scaling_factor=self.rope_scaling_factor,
            kv_channels=self.head_dim, add_qkv_bias=self.qkv_bias, norm_epsilon=self.rms_norm_eps,
            swiglu=True, qk_layernorm=self.qk_norm, share_embeddings=self.tie_word_embeddings,
            make_vocab_size_divisible_by=vocab_multiple(self.vocab_size))


def vocab_multiple(vocab_size: int) -> int:
    """The largest power of two up to 128 dividing `vocab_size`, so Megatron pads nothing."""
    multiple = 128
    while vocab_size % multiple:
        multiple //= 2
    return multiple


def read_config_json(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_FILE}; pass a Hugging Face model "
                              "directory (config.json + *.safetensors)")
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); restore the file") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds no JSON object; restore the file")
    return config


def _rope(config: dict, where: Path) -> tuple[float, Optional[float]]:
    """(rope_theta, Llama 3 scaling factor or None), refusing scalings Megatron lacks."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise CheckpointError(f"{where}: rope scaling {kind!r} is not supported (only Llama 3's "
                              "'llama3' scaling and none); convert a model without it")
    for name, value in LLAMA3_ROPE.items():
        if float(scaling.get(name, value)) != value:
            raise CheckpointError(f"{where}: llama3 rope scaling with {name}="
                                  f"{scaling.get(name)} differs from Megatron-Core's fixed "
                                  f"{value}; this model cannot be reproduced exactly")
    return float(theta), float(scaling["factor"])


def read_hf_arch(directory: Path) -> HFArch:
    """The architecture of the dense Hugging Face model in `directory`, checked to be one megamoe
    reproduces exactly (see the module docstring)."""
    config = read_config_json(directory)
    where = directory / CONFIG_FILE
    kind = config.get("model_type")
    if kind in MOE_TYPES or any(config.get(key) for key in MOE_CONFIG_KEYS):
        raise CheckpointError(f"{where}: model_type {kind!r} is already an MoE model; the "
                              "upcycler needs a dense Llama, Mistral or Qwen2/Qwen3 model")
    if kind not in DENSE_TYPES:
        raise CheckpointError(f"{where}: unknown architecture model_type={kind!r}; supported: "
                              f"{', '.join(DENSE_TYPES)}")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{where}: the model is quantised ({method}); convert an "
                              "unquantised (fp32/bf16/fp16) checkpoint")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act={config['hidden_act']!r}; megamoe's SwiGLU "
                              "uses silu")
    if config.get("use_sliding_window") and kind in ("qwen2", "qwen3"):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported (megamoe "
                              "trains full causal attention)")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        theta, factor = _rope(config, where)
        return HFArch(
            model_type=kind, num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]), rope_theta=theta, rope_scaling_factor=factor,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=kind == "qwen3",
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)))
    except KeyError as err:
        raise CheckpointError(f"{where} lacks {err.args[0]!r}; it is not a complete "
                              f"{kind} config") from None
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: a field has the wrong type ({err})") from None
