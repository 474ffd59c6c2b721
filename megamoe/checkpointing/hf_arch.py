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

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megamoe.bounded import read_json
from megamoe.checkpointing.quantized import quantization_of
from megamoe.errors import CheckpointError
from megamoe.paths import inside

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 1 << 20
"""A config.json larger than this (1 MiB) is refused unread."""
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
            rotary_base=self.rope_theta, rope_scaling_factor=self.rope_scaling_factor,
            kv_channels=self.head_dim, add_qkv_bias=self.qkv_bias, norm_epsilon=self.rms_norm_eps,
            swiglu=True, qk_layernorm=self.qk_norm, share_embeddings=self.tie_word_embeddings,
            make_vocab_size_divisible_by=vocab_multiple(self.vocab_size))


def megatron_lm_rotary_base(theta: float) -> int | float:
    """`theta` as Megatron-LM's `--rotary-base` (an integer flag) takes it: an int when it is a
    whole number a float holds exactly (below 2**53), else the float itself, never rounded (a
    fractional base cannot be given as that flag; Megatron-Core's modules take it as it is)."""
    return int(theta) if theta.is_integer() and abs(theta) < 2 ** 53 else theta


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
    config = read_json(inside(directory, CONFIG_FILE), MAX_CONFIG_BYTES, CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds no JSON object; restore the file")
    return config


def _rope(config: dict, where: Path) -> tuple[Any, Optional[float]]:
    """(rope_theta as given, Llama 3 scaling factor or None), refusing scalings Megatron
    lacks."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise CheckpointError(f"{where}: rope_parameters / rope_scaling must be JSON objects; "
                              "the config is corrupt")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{where}: rope scaling {kind!r} is not supported (only Llama 3's "
                              "'llama3' scaling and none); convert a model without it")
    for name, value in LLAMA3_ROPE.items():
        if float(scaling.get(name, value)) != value:
            raise CheckpointError(f"{where}: llama3 rope scaling with {name}="
                                  f"{scaling.get(name)} differs from Megatron-Core's fixed "
                                  f"{value}; this model cannot be reproduced exactly")
    return theta, positive_field(scaling.get("factor"), "rope_scaling.factor", where)


def read_hf_arch(directory: Path) -> HFArch:
    """The architecture of the dense Hugging Face model in `directory`, checked to be one megamoe
    reproduces exactly (see the module docstring)."""
    config = read_config_json(directory)
    where = directory / CONFIG_FILE
    kind = config.get("model_type")
    if kind in MOE_TYPES or any(config.get(key) for key in MOE_CONFIG_KEYS):
        raise CheckpointError(f"{where}: model_type {kind!r} is already an MoE model; import it "
                              "with tools/import_hf.py (the upcycler needs a dense Llama, "
                              "Mistral or Qwen2/Qwen3 model)")
    if kind not in DENSE_TYPES:
        raise CheckpointError(f"{where}: unknown architecture model_type={kind!r}; supported: "
                              f"{', '.join(DENSE_TYPES)}")
    if config.get("quantization_config"):
        raise CheckpointError(f"{where}: the dense model is quantised; convert an unquantised "
                              "(fp32/bf16/fp16) checkpoint (quantised MoE releases import "
                              "with tools/import_hf.py)")
    return parse_hf_arch(config, where, qkv_bias=kind == "qwen2" or
                         bool(config.get("attention_bias", False)), qk_norm=kind == "qwen3")


def parse_hf_arch(config: dict, where: Path, qkv_bias: bool, qk_norm: bool) -> HFArch:
    """The attention, dense-MLP, norm and RoPE settings of any supported `config` (dense or
    MoE), refusing what megamoe cannot reproduce; `qkv_bias` and `qk_norm` as the
    architecture defines them."""
    kind = config.get("model_type")
    quantization_of(config, where)  # refuses a quantisation the import cannot dequantise
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act={config['hidden_act']!r}; megamoe's SwiGLU "
                              "uses silu")
    if config.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported (megamoe "
                              "trains full causal attention)")
    try:
        sizes = {name: whole_field(config, name, where) for name in SIZE_LIMITS
                 if config.get(name) is not None}
        heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
        kv_heads = sizes.get("num_key_value_heads", heads)
        if heads % kv_heads:
            raise CheckpointError(f"{where}: num_key_value_heads={kv_heads} does not divide "
                                  f"num_attention_heads={heads}; the config is inconsistent")
        if "head_dim" not in sizes and hidden % heads:
            raise CheckpointError(f"{where}: hidden_size={hidden} is not a multiple of "
                                  f"num_attention_heads={heads} and no head_dim is given")
        theta, factor = _rope(config, where)
        return HFArch(
            model_type=kind, num_layers=sizes["num_hidden_layers"], hidden_size=hidden,
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=sizes.get("head_dim", hidden // heads),
            intermediate_size=sizes["intermediate_size"], vocab_size=sizes["vocab_size"],
            rope_theta=positive_field(theta, "rope_theta", where), rope_scaling_factor=factor,
            rms_norm_eps=positive_field(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, qk_norm=qk_norm,
            max_position_embeddings=sizes.get("max_position_embeddings", 4096))
    except KeyError as err:
        raise CheckpointError(f"{where} lacks {err.args[0]!r}; it is not a complete "
                              f"{kind} config") from None
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: a field has the wrong type ({err})") from None


# The sizes read from config.json and the largest accepted (well above any released model), so
# an absurd value is refused before anything is allocated for it.
SIZE_LIMITS = {"num_hidden_layers": 1 << 12, "hidden_size": 1 << 17,
               "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
               "head_dim": 1 << 12, "intermediate_size": 1 << 20, "vocab_size": 1 << 24,
               "max_position_embeddings": 1 << 24}


def whole_field(config: dict, name: str, where: Path, limit: Optional[int] = None) -> int:
    """config[name] as a whole number in 1..limit (default SIZE_LIMITS[name]), else a one-line
    error."""
    value, limit = config[name], limit or SIZE_LIMITS[name]
    whole = isinstance(value, int) and not isinstance(value, bool)
    if not whole or not 1 <= value <= limit:
        raise CheckpointError(f"{where}: {name}={value!r:.40} must be a whole number from 1 to "
                              f"{limit:,}; the config is corrupt or not a model's")
    return value


def positive_field(value: Any, name: str, where: Path) -> float:
    """`value` (a JSON number, not a string or a boolean) as a positive finite float, exactly
    as given (no rounding), else a one-line error."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CheckpointError(f"{where}: {name}={value!r:.40} must be a number")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise CheckpointError(f"{where}: {name}={value!r:.40} must be a positive finite number")
    return number
