"""The dense model's architecture, as far as a checkpoint tells it, for `verify`.

Shapes and key names give the layer count, hidden and FFN sizes, GLU or not, norm type, QK norm,
vocabulary, position embeddings and tied output weights. The attention head count is not in the
tensors: it comes from Megatron-LM's saved `args` when present, else from overrides.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn.functional as F

from megamoe.checkpointing.source import DenseSource
from megamoe.errors import ConfigError

GPT_FIELDS = ("vocab_size", "max_sequence_length", "position_embedding_type", "rotary_base",
              "rotary_percent", "share_embeddings_and_output_weights", "rope_scaling",
              "rope_scaling_factor")


@dataclass
class DenseArch:
    config: dict = field(default_factory=dict)
    """TransformerConfig fields."""
    gpt: dict = field(default_factory=dict)
    """GPTModel arguments."""
    normalization: str = "LayerNorm"
    qk_layernorm: bool = False


def activation_function(name: str):
    if name == "squared_relu":
        from megatron.core.activations import squared_relu

        return squared_relu
    return {"swiglu": F.silu, "gelu": F.gelu, "relu": F.relu}[name]


def dense_arch(source: DenseSource, record: dict, overrides: dict[str, Any]) -> DenseArch:
    """Model settings of the dense checkpoint (recorded facts, args, then `overrides`)."""
    layer = source.layer(0)
    args = source.args
    shapes = {key: tuple(tensor.shape) for key, tensor in source.non_layer_tensors()}
    normalization = ("LayerNorm" if "self_attention.linear_qkv.layer_norm_bias" in layer.tensors
                     else "RMSNorm")
    qk_layernorm = "self_attention.q_layernorm.weight" in layer.tensors
    learned = "embedding.position_embeddings.weight" in shapes
    config = dict(
        num_layers=source.num_layers,
        hidden_size=record["hidden_size"],
        ffn_hidden_size=record["dense_ffn_hidden_size"],
        gated_linear_unit=record["gated"],
        activation_func=activation_function(record["activation"]),
        normalization=normalization,
        qk_layernorm=qk_layernorm,
        add_qkv_bias="self_attention.linear_qkv.bias" in layer.tensors,
        num_attention_heads=getattr(args, "num_attention_heads", None),
        num_query_groups=(getattr(args, "num_query_groups", None)
                          if getattr(args, "group_query_attention", False) else None),
        kv_channels=getattr(args, "kv_channels", None),
        layernorm_epsilon=getattr(args, "norm_epsilon", 1e-5),
    )
    gpt = dict(
        vocab_size=shapes["embedding.word_embeddings.weight"][0],
        max_sequence_length=(shapes["embedding.position_embeddings.weight"][0] if learned
                             else getattr(args, "max_position_embeddings", 4096)),
        position_embedding_type="learned_absolute" if learned else "rope",
        rotary_base=getattr(args, "rotary_base", 10000),
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        share_embeddings_and_output_weights="output_layer.weight" not in shapes,
    )
    for name, value in overrides.items():
        (gpt if name in GPT_FIELDS else config)[name] = value
    if config["num_attention_heads"] is None:
        raise ConfigError("--verify needs the attention head count, which this checkpoint does "
                          "not record (no Megatron-LM args); pass --arch num_attention_heads=N "
                          "(and num_query_groups=G for grouped-query attention)")
    return DenseArch(config, gpt, normalization, qk_layernorm)
