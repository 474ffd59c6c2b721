"""Small Megatron-Core model builders with CPU-safe settings, for tests and examples."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

_TINY_DEFAULTS = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
    # Megatron's MLP with a linear bias trips an in-place-on-view autograd error on CPU.
    add_bias_linear=False,
    # Otherwise weights are allocated on the current CUDA device.
    use_cpu_initialization=True,
    params_dtype=torch.float32,
    bf16=False,
    fp16=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    init_method_std=0.02,
)


def tiny_transformer_config(**overrides) -> TransformerConfig:
    """A small fp32 TransformerConfig that Megatron's local modules can run on CPU.

    Defaults: 2 layers, hidden 64, 4 heads, FFN 128, no linear biases, no dropout, weights
    initialised on CPU. Any TransformerConfig field can be overridden, e.g.
    `tiny_transformer_config(num_moe_experts=4, moe_router_topk=2)`.
    """
    return TransformerConfig(**{**_TINY_DEFAULTS, **overrides})


def causal_attention_mask(seq_len: int) -> torch.Tensor:
    """Boolean causal mask of shape [1, 1, seq_len, seq_len]; True marks a masked-out position.

    This is the form Megatron's local attention takes (it broadcasts over batch and heads).
    Passing it avoids `attention_mask=None`, for which Megatron builds the mask on CUDA.
    """
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)
    return future.view(1, 1, seq_len, seq_len)


def attention_mask_for(seq_len: int, on_cuda: bool) -> Optional[torch.Tensor]:
    """The mask to pass a GPTModel: None on CUDA, where Megatron's attention builds its own causal
    mask, and `causal_attention_mask` on the CPU."""
    return None if on_cuda else causal_attention_mask(seq_len)


def build_gpt(
    config: TransformerConfig,
    layer_spec: ModuleSpec | TransformerBlockSubmodules,
    vocab_size: int,
    seq_len: int,
) -> GPTModel:
    """A single-stage GPTModel: embedding, decoder, output head.

    `layer_spec` is one layer's spec (repeated `config.num_layers` times) or a whole decoder
    block spec, as `GPTModel` accepts.
    Learned absolute position embeddings up to `seq_len`; input embeddings and output weights
    are not shared.
    """
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
