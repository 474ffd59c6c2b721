"""Megatron's local GPT layer spec with its linears and norms swapped for other modules.

For methods that re-parametrise every weight of a dense model (SIMoE's interpolated experts,
LoRA): one function builds the decoder block spec, so each method only names its modules.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megamoe.megatron.compat import replace_submodules as _replace


def local_block_spec_with(config: TransformerConfig, column: ModuleSpec, row: ModuleSpec,
                          norm: Optional[ModuleSpec] = None) -> TransformerBlockSubmodules:
    """Every layer's QKV and fc1 built as `column`, attention output and fc2 as `row`, and (if
    given) the input, pre-MLP and final norms as `norm`; the rest is Megatron's local spec."""
    dense = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                     normalization=config.normalization)
    layer = dense.submodules
    norms = {} if norm is None else {"input_layernorm": norm, "pre_mlp_layernorm": norm}
    spec = _replace(
        dense, **norms,
        self_attention=_replace(layer.self_attention, linear_qkv=column, linear_proj=row),
        mlp=_replace(layer.mlp, linear_fc1=column, linear_fc2=row),
    )
    final_norm = norm if norm is not None else layer.input_layernorm
    return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=final_norm)
