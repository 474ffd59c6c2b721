"""The `model` section: the GPT architecture (Megatron-Core GPTModel) around the MoE layers.

Every field declares its role (`megamoe.settings`): dropout and the initialisation's std say how
the model is trained, everything else what the weights mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from megamoe.config import moe_layer_pattern
from megamoe.errors import ConfigError
from megamoe.settings import brief, closest, model_setting, training_setting
from megamoe.settings import check_choice
from megamoe.train.settings.checks import require

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
YARN_KEYS = {"factor": None, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""`model.yarn`'s settings and their defaults (None: required)."""


@dataclass
class ModelConfig:
    """The GPT architecture (Megatron-Core GPTModel) around the MoE layers."""

    num_layers: int = model_setting(4)
    """Transformer layers."""
    hidden_size: int = model_setting(128)
    """Model width D (the MoE layers' `hidden_size` too)."""
    num_attention_heads: int = model_setting(4)
    """Attention heads."""
    num_query_groups: Optional[int] = model_setting(None)
    """Grouped-query attention: key/value heads (None: one per attention head)."""
    ffn_hidden_size: int = model_setting(512)
    """MLP size of the dense (non-MoE) layers."""
    seq_length: int = model_setting(128)
    """Tokens per training sample."""
    normalization: str = model_setting("RMSNorm")
    """`RMSNorm` or `LayerNorm`."""
    position_embedding: str = model_setting("learned_absolute")
    """`learned_absolute` or `rope` (rotary position embedding, arXiv 2104.09864)."""
    rotary_base: float = model_setting(10000.0)
    """RoPE base period (Llama 3: 500000, Qwen2: 1000000; a fractional one is kept as it is)."""
    rope_scaling_factor: Optional[float] = model_setting(None)
    """Llama 3.1's RoPE frequency scaling with this factor (Megatron-Core's `rope_scaling`:
    low/high frequency factors 1 and 4, original context 8192); None: no scaling."""
    kv_channels: Optional[int] = model_setting(None)
    """Attention head dimension (None: hidden_size / num_attention_heads)."""
    add_qkv_bias: bool = model_setting(False)
    """Biases on the query, key and value projections (Qwen2)."""
    norm_epsilon: float = model_setting(1e-5)
    """Epsilon of the RMSNorm/LayerNorm denominators (Qwen2: 1e-6)."""
    swiglu: bool = model_setting(True)
    """Dense MLPs (and, unless `moe.experts.activation` says otherwise, experts) use SwiGLU."""
    qk_layernorm: bool = model_setting(False)
    """Normalise queries and keys before attention (always on with
    `multi_latent_attention`: its query and key-value latents are RMS-normalised)."""
    multi_latent_attention: bool = model_setting(False)
    """Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, sec. 2.1): queries
    and keys/values through normalised low-rank latents, RoPE on a decoupled part of each
    query and key head (Megatron-Core's MLASelfAttention). Needs `position_embedding: rope`
    (its `rotary_base` applies) and one key-value head per attention head."""
    q_lora_rank: Optional[int] = model_setting(None)
    """MLA: rank of the query latent (DeepSeek-V3: 1536); None: queries projected from the
    hidden state directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = model_setting(512)
    """MLA: rank of the key-value latent (DeepSeek-V2/V3: 512)."""
    qk_head_dim: int = model_setting(128)
    """MLA: query/key head dimension without RoPE."""
    qk_pos_emb_head_dim: int = model_setting(64)
    """MLA: query/key head dimension that carries RoPE (the key part is shared by all heads);
    the softmax scale is 1/sqrt(qk_head_dim + qk_pos_emb_head_dim)."""
    v_head_dim: int = model_setting(128)
    """MLA: value head dimension."""
    yarn: dict = model_setting(default_factory=dict)
    """MLA: YaRN context extension of its RoPE (arXiv 2309.00071), as DeepSeek-V2/V3 set it:
    `{factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}`
    (defaults: factor required, 4096, 32, 1, 1, 0); empty: plain RoPE."""
    share_embeddings: bool = model_setting(False)
    """Tie the input embedding and the output layer."""
    init_method_std: float = training_setting(0.02)
    """Std of the normal weight initialisation (and, unless `moe.init_method_std` is given, of
    the experts')."""
    hidden_dropout: float = training_setting(0.0)
    """Dropout after attention and MLP."""
    attention_dropout: float = training_setting(0.0)
    """Dropout on attention probabilities."""
    first_k_dense: int = model_setting(0)
    """The first k layers have a dense MLP instead of experts (DeepSeek-V3 uses 3)."""
    moe_layer_freq: Union[int, list[int]] = model_setting(1)
    """MoE layer pattern: every n-th layer, or a 0/1 list with one entry per layer."""
    make_vocab_size_divisible_by: int = model_setting(128)
    """Pad the tokenizer's vocabulary to a multiple of this (times tensor-parallel size)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "seq_length"):
            require(getattr(self, name) >= 1, f"model.{name}={getattr(self, name)} must be >= 1")
        require(self.hidden_size % self.num_attention_heads == 0,
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; pick a divisor")
        check_choice("model.normalization", self.normalization, NORMALIZATIONS)
        check_choice("model.position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        self._check_ranges()
        try:
            moe_layer_pattern(self, self.first_k_dense)
        except ConfigError as error:
            raise ConfigError(f"model.{error}") from None
        self._check_latent_attention()

    def _check_ranges(self) -> None:
        """Values Megatron-Core or PyTorch would reject with a traceback later."""
        groups = self.num_query_groups
        require(groups is None or (groups >= 1 and self.num_attention_heads % groups == 0),
                f"model.num_query_groups={groups} must divide model.num_attention_heads="
                f"{self.num_attention_heads} (or be null)")
        require(self.init_method_std > 0,
                f"model.init_method_std={self.init_method_std} must be > 0")
        require(self.norm_epsilon > 0, f"model.norm_epsilon={self.norm_epsilon} must be > 0")
        require(self.kv_channels is None or self.kv_channels >= 1,
                f"model.kv_channels={self.kv_channels} must be >= 1 or null")
        require(self.rope_scaling_factor is None or self.rope_scaling_factor >= 1,
                f"model.rope_scaling_factor={self.rope_scaling_factor} must be >= 1 or null")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0 <= value < 1, f"model.{name}={value} must be in [0, 1)")
        require(self.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by="
                f"{self.make_vocab_size_divisible_by} must be >= 1")
        require(self.rotary_base > 0, f"model.rotary_base={self.rotary_base} must be > 0")

    def _check_latent_attention(self) -> None:
        """MLA's sizes, and the settings it replaces or cannot be combined with."""
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            require(getattr(self, name) >= 1, f"model.{name}={getattr(self, name)} must be >= 1")
        require(self.q_lora_rank is None or self.q_lora_rank >= 1,
                f"model.q_lora_rank={self.q_lora_rank} must be >= 1 or null")
        require(self.qk_pos_emb_head_dim % 2 == 0, "model.qk_pos_emb_head_dim="
                f"{self.qk_pos_emb_head_dim} must be even (RoPE rotates pairs of channels)")
        if not self.multi_latent_attention:
            require(not self.yarn, f"model.yarn={brief(self.yarn)} is MLA's YaRN; set "
                    "model.multi_latent_attention=true, or model.rope_scaling_factor for "
                    "Llama 3's")
            return
        require(self.position_embedding == "rope", f"model.position_embedding="
                f"{self.position_embedding!r} cannot be combined with "
                "model.multi_latent_attention, which applies its own RoPE; set "
                "model.position_embedding=rope")
        require(self.num_query_groups in (None, self.num_attention_heads),
                f"model.num_query_groups={self.num_query_groups} cannot be combined with "
                "model.multi_latent_attention (one key-value head per attention head); set it "
                "null")
        for key, value, fix in [
                ("model.rope_scaling_factor", self.rope_scaling_factor, "use model.yarn for MLA"),
                ("model.kv_channels", self.kv_channels,
                 "set model.qk_head_dim and model.v_head_dim"),
                ("model.add_qkv_bias", self.add_qkv_bias or None,
                 "MLA's projections have no bias")]:
            require(value is None, f"{key}={value} cannot be combined with "
                    f"model.multi_latent_attention; {fix} and set {key} back to its default")
        _check_yarn(self.yarn)


def _check_yarn(yarn: dict) -> None:
    """`model.yarn`: known keys, a factor, numbers in range."""
    for key in yarn:
        near = closest(str(key), list(YARN_KEYS))
        require(key in YARN_KEYS, f"model.yarn has unknown key {brief(key)}"
                f"{f'; did you mean {near!r}?' if near else ''} (keys: {list(YARN_KEYS)})")
    if not yarn:
        return
    require("factor" in yarn, "model.yarn needs a factor (the context extension, e.g. 40)")
    for key, value in yarn.items():
        require(isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value), f"model.yarn.{key}={brief(value)} must be a number")
    settings = yarn_settings(yarn)
    require(settings["factor"] >= 1, f"model.yarn.factor={settings['factor']} must be >= 1")
    for key in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
        require(settings[key] > 0, f"model.yarn.{key}={settings[key]} must be > 0")
    for key in ("mscale", "mscale_all_dim"):
        require(settings[key] >= 0, f"model.yarn.{key}={settings[key]} must be >= 0")


def yarn_settings(yarn: dict) -> dict:
    """`model.yarn` with the defaults of YARN_KEYS filled in."""
    return {**YARN_KEYS, **yarn}
