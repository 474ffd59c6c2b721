"""Megatron-Core specs with megamoe layers in the `mlp` slot.

- `moe_mlp_spec(**moe)`: the mlp-slot spec (a ModuleSpec of MegatronMoELayer).
- `gpt_layer_spec(**moe)`: a full GPT TransformerLayer spec with a megamoe MLP.
- `gpt_decoder_block_spec(config, ...)`: a decoder block spec interleaving dense and megamoe
  layers (Megatron's `moe_layer_freq`, a 0/1 list, or "first k dense"), with optional per-layer
  MoE overrides, so layers may differ in experts, top-k or router.

For Megatron-LM's `pretrain_gpt.py --spec megamoe.megatron.specs NAME`: `layer_spec` is a
module-level ModuleSpec (versions that use the object directly), and `decoder_block_spec` is a
callable taking `(config, vp_stage=None)` (versions that call it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megamoe.errors import ConfigError
from megamoe.megatron.moe_module import MegatronMoELayer


def transformer_engine_available() -> bool:
    """Transformer Engine is used only when it imports (it needs CUDA)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def moe_mlp_spec(**moe: Any) -> ModuleSpec:
    """The `mlp` slot spec: a megamoe layer with MoEConfig overrides `moe`."""
    return ModuleSpec(module=MegatronMoELayer, params={"moe": dict(moe)})


def _base_layer_spec(config: Any, moe: bool, use_te: bool) -> ModuleSpec:
    """Megatron's own GPT layer spec (its MoE variant for MoE layers, which keeps a separate
    pre-MLP norm under Transformer Engine)."""
    kwargs = dict(qk_layernorm=getattr(config, "qk_layernorm", False) if config else False)
    if moe:
        kwargs.update(num_experts=2, moe_grouped_gemm=False)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(**kwargs)
    return get_gpt_layer_local_spec(normalization=getattr(config, "normalization", None)
                                    if config else None, **kwargs)


def gpt_layer_spec(config: Any = None, use_transformer_engine: Optional[bool] = None,
                   **moe: Any) -> ModuleSpec:
    """A GPT TransformerLayer spec whose MLP is a megamoe layer."""
    use_te = transformer_engine_available() if use_transformer_engine is None else \
        use_transformer_engine
    base = _base_layer_spec(config, moe=True, use_te=use_te)
    submodules = dataclasses.replace(base.submodules, mlp=moe_mlp_spec(**moe))
    return dataclasses.replace(base, submodules=submodules)


def moe_layer_pattern(config: Any, first_k_dense: int = 0) -> list[bool]:
    """Which layers are MoE: Megatron's `moe_layer_freq` (every n-th, or a 0/1 list of length
    num_layers), with the first `first_k_dense` layers forced dense (DeepSeek-V3 style)."""
    freq, n = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):
        if freq <= 0:
            raise ConfigError(f"moe_layer_freq={freq} must be >= 1")
        pattern = [i % freq == 0 for i in range(n)]
    else:
        if len(freq) != n or any(v not in (0, 1) for v in freq):
            raise ConfigError(
                f"moe_layer_freq={freq} must be a 0/1 list of length num_layers={n}"
            )
        pattern = [bool(v) for v in freq]
    if not 0 <= first_k_dense <= n:
        raise ConfigError(f"first_k_dense={first_k_dense} must be in 0..num_layers={n}")
    return [moe and i >= first_k_dense for i, moe in enumerate(pattern)]


def gpt_decoder_block_spec(config: Any, first_k_dense: int = 0,
                           layer_overrides: Optional[dict[int, dict]] = None,
                           use_transformer_engine: Optional[bool] = None,
                           vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                           **moe: Any) -> TransformerBlockSubmodules:
    """Decoder block spec: dense layers and megamoe layers as `moe_layer_pattern` says.

    layer_overrides: {layer index (0-based, global): MoEConfig overrides} on top of `moe`, for
    layers that differ (e.g. {5: {"num_experts": 16, "topk": 4}}).
    Only this pipeline stage's layers are returned, like Megatron's get_gpt_decoder_block_spec.
    """
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise ConfigError(
            "pipeline_model_parallel_layout is not supported by megamoe's block spec; use "
            "num_layers_in_first/last_pipeline_stage instead"
        )
    use_te = transformer_engine_available() if use_transformer_engine is None else \
        use_transformer_engine
    overrides = layer_overrides or {}
    pattern = moe_layer_pattern(config, first_k_dense)
    bad = sorted(i for i in overrides if not (0 <= i < len(pattern) and pattern[i]))
    if bad:
        raise ConfigError(f"layer_overrides for layers {bad}, which are not MoE layers")
    dense = _base_layer_spec(config, moe=False, use_te=use_te)
    specs = [gpt_layer_spec(config, use_te, **{**moe, **overrides.get(i, {})}) if is_moe else dense
             for i, is_moe in enumerate(pattern)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    # The MoE layer spec's pre-MLP norm is a real norm under both backends (Transformer Engine's
    # dense spec fuses its norms into the linear layers).
    norm = gpt_layer_spec(config, use_te).submodules.pre_mlp_layernorm
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count], layer_norm=norm)


layer_spec = gpt_layer_spec(use_transformer_engine=False)
"""Module-level GPT layer spec for `pretrain_gpt.py --spec megamoe.megatron.specs layer_spec`
(local Megatron modules; the MoE settings come from the `--moe-*` flags)."""


def decoder_block_spec(config: Any, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """Callable form for `--spec megamoe.megatron.specs decoder_block_spec`."""
    return gpt_decoder_block_spec(config, vp_stage=vp_stage)


__all__ = ["decoder_block_spec", "gpt_decoder_block_spec", "gpt_layer_spec", "layer_spec",
           "moe_layer_pattern", "moe_mlp_spec", "transformer_engine_available"]
