"""Small Megatron-Core models with CPU-safe settings, for the tests."""
from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megamoe.megatron.cpu import cpu_transformer_config

_TINY_DEFAULTS = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
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
    return cpu_transformer_config(**{**_TINY_DEFAULTS, **overrides})


def build_gpt(
    config: TransformerConfig,
    layer_spec: ModuleSpec | TransformerBlockSubmodules,
    vocab_size: int,
    seq_len: int,
    position_embedding_type: str = "learned_absolute",
    mtp_block_spec=None,
) -> GPTModel:
    """A single-stage GPTModel: embedding, decoder, output head (and the multi-token
    prediction block of `mtp_block_spec`, if given).

    `layer_spec` is one layer's spec (repeated `config.num_layers` times) or a whole decoder
    block spec, as `GPTModel` accepts.
    Learned absolute position embeddings up to `seq_len` (or `position_embedding_type`); input
    embeddings and output weights are not shared.
    """
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type=position_embedding_type,
        mtp_block_spec=mtp_block_spec,
    )
