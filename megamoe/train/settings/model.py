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
from megamoe.settings import (brief, check_choice, check_fields, closest, model_setting,
                              training_setting)
from megamoe.train.settings.checks import require

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
QK_NORM_SCOPES = ("head", "projection")
YARN_KEYS = {"factor": None, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""`model.yarn`'s settings and their defaults (None: required)."""
YARN_FLAGS = {"truncate": True}
"""`model.yarn`'s true/false settings and their defaults (not in `yarn_settings`)."""


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
    add_bias_linear: bool = model_setting(False)
    """Biases on the attention's output projection and on its query, key and value
    projections, and on the dense layers' MLPs (Megatron-Core's `add_bias_linear`; GPT-OSS's
    q/k/v/o biases). The experts' biases are `moe.experts.bias`."""
    attention_sinks: bool = model_setting(False)
    """One learned sink logit per attention head that joins every query's softmax over the
    keys and takes its share of the probability with it (the sink's column is dropped), so a
    head can attend to nothing (GPT-OSS; "attention sinks", Xiao et al., arXiv 2309.17453;
    Megatron-Core's `softmax_type: learnable`)."""
    sliding_window: Optional[int] = model_setting(None)
    """Sliding-window attention: each token attends to itself and the `sliding_window - 1`
    tokens before it (transformers' `sliding_window`; GPT-OSS: 128, Mistral 7B: 4096); None:
    every layer attends to the whole causal context."""
    sliding_window_layers: Optional[list[int]] = model_setting(None)
    """Which layers use `sliding_window`: one 0/1 per layer, 1 = sliding (transformers'
    `layer_types`; GPT-OSS alternates, its first layer sliding); None: every layer."""
    norm_epsilon: float = model_setting(1e-5)
    """Epsilon of the RMSNorm/LayerNorm denominators (Qwen2: 1e-6)."""
    swiglu: bool = model_setting(True)
    """Dense MLPs (and, unless `moe.experts.activation` says otherwise, experts) use SwiGLU."""
    qk_layernorm: bool = model_setting(False)
    """Normalise queries and keys before attention (always on with
    `multi_latent_attention`: its query and key-value latents are RMS-normalised)."""
    qk_layernorm_scope: str = model_setting("head")
    """What `qk_layernorm` normalises: `head`, each query and key head on its own (Qwen3,
    GLM-4.5's `use_qk_norm`), or `projection`, the whole query projection (heads x head size)
    and the whole key projection with one RMSNorm each (MiniMax-M2)."""
    rotary_percent: float = model_setting(1.0)
    """Partial RoPE: the fraction of each query/key head's channels that are rotated, the first
    ones (Megatron-Core's `rotary_percent`; GLM-4.5: 0.5, MiniMax-M2: rotary_dim / head_dim);
    the rest carry no position."""
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
    """YaRN context extension of RoPE (arXiv 2309.00071), as transformers'
    `_compute_yarn_parameters` computes it, for MLA (DeepSeek-V2/V3) and for grouped-query
    attention (GPT-OSS: factor 32 over 4096, truncate false): `{factor,
    original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, truncate}`
    (defaults: factor required, 4096, 32, 1, 1, 0, true). cos and sin are scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are non-zero, else by
    0.1 ln(factor) + 1; `truncate: false` keeps the correction range's bounds unrounded
    (grouped-query attention only). Empty: plain RoPE."""
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
    mtp_layers: int = model_setting(0)
    """Multi-token prediction depth D (DeepSeek-V3 tech report, arXiv 2412.19437, sec. 2.2;
    Megatron-Core's `mtp_num_layers`): D sequential modules on the last pipeline stage, module k
    projecting [RMSNorm(Emb(t_(i+k))); RMSNorm(h_i^(k-1))] to the width, then one transformer
    layer of the last decoder layer's kind, predicting t_(i+k+1) through the shared embedding and
    output head (DeepSeek-V3 and GLM-4.5: 1, `num_nextn_predict_layers`); 0: none."""
    mtp_loss_weight: float = training_setting(0.1)
    """The MTP loss weight lambda (Megatron-Core's `mtp_loss_scaling_factor`): the training loss
    adds (lambda / D) * sum_k loss_k (DeepSeek-V3: 0.3 for its first 10T tokens, 0.1 after)."""

    def __post_init__(self) -> None:
        check_fields(self, "model")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "seq_length"):
            require(getattr(self, name) >= 1, f"model.{name}={getattr(self, name)} must be >= 1")
        # With kv_channels set, the heads' width need not be the model's (GLM-4.5: 5120 wide,
        # 96 heads of 128).
        require(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; pick a divisor or set "
                "model.kv_channels (the head size)")
        check_choice("model.normalization", self.normalization, NORMALIZATIONS)
        check_choice("model.position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        self._check_ranges()
        self._check_rotary_and_qk_norm()
        try:
            moe_layer_pattern(self, self.first_k_dense)
        except ConfigError as error:
            raise ConfigError(f"model.{error}") from None
        self._check_latent_attention()
        self._check_gpt_oss_attention()

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
        require(self.mtp_layers >= 0, f"model.mtp_layers={self.mtp_layers} must be >= 0 (0: no "
                "multi-token prediction)")
        require(self.mtp_loss_weight >= 0,
                f"model.mtp_loss_weight={self.mtp_loss_weight} must be >= 0")

    def _check_rotary_and_qk_norm(self) -> None:
        """`rotary_percent` leaves an even, non-empty rotated part of each head under RoPE;
        `qk_layernorm_scope` is a choice that needs `qk_layernorm` (MLA has its own norms and
        RoPE, so neither applies to it)."""
        check_choice("model.qk_layernorm_scope", self.qk_layernorm_scope, QK_NORM_SCOPES)
        percent = self.rotary_percent
        require(isinstance(percent, (int, float)) and 0 < percent <= 1,
                f"model.rotary_percent={percent} must be in (0, 1] (e.g. 0.5 rotates half of "
                "each head)")
        if percent < 1:
            require(self.position_embedding == "rope" and not self.multi_latent_attention,
                    f"model.rotary_percent={percent} needs model.position_embedding=rope "
                    "without model.multi_latent_attention; set it to 1.0")
            head = self.kv_channels or self.hidden_size // self.num_attention_heads
            rotated = int(head * percent)
            require(rotated >= 2 and rotated % 2 == 0,
                    f"model.rotary_percent={percent} rotates {rotated} of the {head} channels "
                    "of a head, which must be even and at least 2 (RoPE rotates pairs); pick a "
                    "fraction that gives an even count")
        if self.qk_layernorm_scope == "projection":
            require(self.qk_layernorm and not self.multi_latent_attention,
                    "model.qk_layernorm_scope='projection' needs model.qk_layernorm=true "
                    "without model.multi_latent_attention; set it to 'head' or turn "
                    "model.qk_layernorm on")

    def _check_latent_attention(self) -> None:
        """MLA's sizes, and the settings it replaces or cannot be combined with."""
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            require(getattr(self, name) >= 1, f"model.{name}={getattr(self, name)} must be >= 1")
        require(self.q_lora_rank is None or self.q_lora_rank >= 1,
                f"model.q_lora_rank={self.q_lora_rank} must be >= 1 or null")
        require(self.qk_pos_emb_head_dim % 2 == 0, "model.qk_pos_emb_head_dim="
                f"{self.qk_pos_emb_head_dim} must be even (RoPE rotates pairs of channels)")
        if not self.multi_latent_attention:
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
                 "MLA's projections have no bias"),
                ("model.add_bias_linear", self.add_bias_linear or None,
                 "MLA's projections have no bias"),
                ("model.attention_sinks", self.attention_sinks or None,
                 "MLA's core attention has no sinks"),
                ("model.sliding_window", self.sliding_window,
                 "MLA's core attention has no sliding window")]:
            require(value is None, f"{key}={value} cannot be combined with "
                    f"model.multi_latent_attention; {fix} and set {key} back to its default")
        _check_yarn(self.yarn)
        require(yarn_truncates(self.yarn), "model.yarn.truncate=false cannot be combined with "
                "model.multi_latent_attention (Megatron-Core's MLA rounds the correction "
                "range); remove it")

    def _check_gpt_oss_attention(self) -> None:
        """The sliding window and its layers, and YaRN for grouped-query attention
        (GPT-OSS's attention; MLA's own checks are `_check_latent_attention`)."""
        window, layers = self.sliding_window, self.sliding_window_layers
        require(window is None or (isinstance(window, int) and not isinstance(window, bool)
                                   and window >= 1),
                f"model.sliding_window={brief(window)} must be a whole number >= 1 or null "
                "(GPT-OSS: 128)")
        if layers is not None:
            require(window is not None, f"model.sliding_window_layers={brief(layers)} needs "
                    "model.sliding_window (the window those layers use); set it or remove the "
                    "list")
            require(isinstance(layers, list) and len(layers) == self.num_layers
                    and all(flag in (0, 1) and not isinstance(flag, float) for flag in layers),
                    f"model.sliding_window_layers={brief(layers)} must list 0 or 1 for each of "
                    f"the model.num_layers={self.num_layers} layers (1: sliding)")
            require(self.mtp_layers == 0, f"model.sliding_window_layers cannot be combined "
                    f"with model.mtp_layers={self.mtp_layers} (the prediction layers have no "
                    "entry); set model.sliding_window_layers null (every layer slides)")
        if self.multi_latent_attention or not self.yarn:
            return
        require(self.position_embedding == "rope", f"model.yarn={brief(self.yarn)} extends "
                f"RoPE, but model.position_embedding={self.position_embedding!r}; set "
                "model.position_embedding=rope")
        require(self.rope_scaling_factor is None, f"model.rope_scaling_factor="
                f"{self.rope_scaling_factor} (Llama 3's scaling) cannot be combined with "
                "model.yarn; keep one of them")
        require(self.rotary_percent == 1, f"model.rotary_percent={self.rotary_percent} cannot "
                "be combined with model.yarn (Megatron-Core's YaRN rotates whole heads); set "
                "it to 1.0")
        _check_yarn(self.yarn)


def _check_yarn(yarn: dict) -> None:
    """`model.yarn`: known keys, a factor, numbers in range, true/false flags."""
    known = [*YARN_KEYS, *YARN_FLAGS]
    for key in yarn:
        near = closest(str(key), known)
        require(key in known, f"model.yarn has unknown key {brief(key)}"
                f"{f'; did you mean {near!r}?' if near else ''} (keys: {known})")
    if not yarn:
        return
    require("factor" in yarn, "model.yarn needs a factor (the context extension, e.g. 40)")
    for key, value in yarn.items():
        if key in YARN_FLAGS:
            require(isinstance(value, bool), f"model.yarn.{key}={brief(value)} must be true "
                    "or false")
            continue
        require(isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value), f"model.yarn.{key}={brief(value)} must be a number")
    settings = yarn_settings(yarn)
    require(settings["factor"] >= 1, f"model.yarn.factor={settings['factor']} must be >= 1")
    for key in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
        require(settings[key] > 0, f"model.yarn.{key}={settings[key]} must be > 0")
    for key in ("mscale", "mscale_all_dim"):
        require(settings[key] >= 0, f"model.yarn.{key}={settings[key]} must be >= 0")


def yarn_settings(yarn: dict) -> dict:
    """`model.yarn`'s numbers with the defaults of YARN_KEYS filled in (its flags:
    `yarn_truncates`)."""
    return {**YARN_KEYS, **{key: value for key, value in yarn.items() if key not in YARN_FLAGS}}


def yarn_truncates(yarn: dict) -> bool:
    """`model.yarn.truncate`: whether YaRN rounds its correction range's bounds to whole
    dimensions (floor, ceil), as transformers does unless a config says `truncate: false`."""
    return bool(yarn.get("truncate", YARN_FLAGS["truncate"]))
