"""Megatron-Core specs with megamoe layers in the `mlp` slot.

Each megamoe layer is configured by an MoEConfig object the spec carries into it (`moe`);
where a spec is made without one, Megatron's `moe_*` settings (Megatron-LM's `--moe-*` flags)
are mapped into it once (`megamoe.megatron.fields.moe_config_from_transformer_config`).
- `moe_mlp_spec(moe)`: the mlp-slot spec (a ModuleSpec of MegatronMoELayer).
- `gpt_layer_spec(config, moe=...)`: a full GPT TransformerLayer spec with a megamoe MLP.
- `gpt_decoder_block_spec(config, moe, ...)`: a decoder block spec interleaving dense and
  megamoe layers (Megatron's `moe_layer_freq`, a 0/1 list, or "first k dense"), with per-layer
  MoEConfig objects, so layers may differ in experts, top-k or router.
- `interleaved_layer_spec(first_k_dense)`: one spec for every layer, whose layers decide dense
  or MoE when they are built (`MegaMoETransformerLayer`).
- `mtp_block_spec(config, moe, ...)`: Megatron-Core's multi-token-prediction block on the last
  stage, its layers of the last decoder layer's kind (megamoe layers in a MoE model).

For Megatron-LM's `pretrain_gpt.py --spec megamoe.megatron.specs NAME`, `layer_spec` and
`decoder_block_spec` work as every Megatron-LM version consumes the named object:
- core_v0.16 to core_v0.18 hand it straight to `GPTModel(transformer_layer_spec=...)`, whose
  TransformerBlock accepts a ModuleSpec of a transformer layer (built once per layer of the
  pipeline stage) or a TransformerBlockSubmodules. Both names are such ModuleSpecs.
- From core_v0.19 the model builder calls `spec(config, vp_stage=...)` if the object is callable
  and not a ModuleSpec, else uses it as is: both names are ModuleSpecs, so they are used as is.
- Called as a spec function, `decoder_block_spec(config, vp_stage=None)` returns the block spec
  for that config (any object whose attribute reads give the TransformerConfig's, such as
  Megatron-LM's GPTModelConfig), and `layer_spec(config)` returns itself.
Dense/MoE interleaving follows `--moe-layer-freq` (int or 0/1 list, which also expresses
first-k-dense) in every case, and the layers use Transformer Engine when it imports and the
config asks for it (`transformer_impl`), the local Megatron modules otherwise.

Before the settings tree, `moe_mlp_spec`, `gpt_layer_spec`, `gpt_decoder_block_spec`,
`interleaved_layer_spec` and layer overrides took the MoE settings as flat keywords
(`gpt_layer_spec(config, activation="gelu", score_function="softmax")`, `OLD_KEYWORDS`). For one
release they are still read, each call with a FutureWarning giving the new form
(`moe=moe_config_from_transformer_config(config, {"router": {"score_function": "softmax"},
"experts": {"activation": "gelu"}})`); any other keyword is a one-line error naming the
closest known one.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable, Optional, Union

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank

from megamoe.balancing.owner import StepOwner
from megamoe.config import (FLAT_NAMES, MoEConfig, is_flat_setting, moe_layer_pattern,
                            nest_flat_settings)
from megamoe.errors import ConfigError
from megamoe.megatron.compat import global_layer_number
from megamoe.megatron.fields import moe_config_from_transformer_config
from megamoe.megatron.latent_attention import with_latent_attention
from megamoe.megatron.local_fallbacks import LAYER_FALLBACKS, enable_local_fallbacks
from megamoe.megatron.moe_module import MegatronMoELayer
from megamoe.megatron.projection_norm import with_qk_norm_scope
from megamoe.megatron.sink_attention import with_sink_attention
from megamoe.megatron.tracker import report_load_metrics
from megamoe.settings import brief, closest, deep_merge, shown

OLD_KEYWORDS = ("hidden_size", "num_experts", "ffn_hidden_size", "topk", "init_method_std",
                *FLAT_NAMES)
"""The flat MoE settings the spec functions took as keywords before the settings tree (the
layer's sizes, and `megamoe.config.FLAT_NAMES`): read for one release, with a FutureWarning."""


class SpecKeywordError(ConfigError, TypeError):
    """A keyword no spec function takes (a TypeError too, as Python's own for an unknown
    keyword)."""


def _check_moe(function: Callable, moe: Any) -> None:
    """Refuse a `moe` that is not a MoEConfig (an old positional call puts another argument
    there)."""
    if moe is not None and not isinstance(moe, MoEConfig):
        raise ConfigError(f"{function.__name__}(moe={brief(moe)}): moe must be a MoEConfig or "
                          f"None, not a {type(moe).__name__}; pass the other arguments by "
                          "keyword")


def _nested_changes(function: Callable, keywords: dict) -> dict:
    """Old flat MoE `keywords` of `function` as nested changes of the settings tree; a keyword
    that is neither one of `function`'s parameters nor an old MoE setting is a one-line error
    naming the closest of those."""
    parameters = [name for name, p in inspect.signature(function).parameters.items()
                  if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for key in keywords:
        if key not in OLD_KEYWORDS:
            near = closest(key, parameters + list(OLD_KEYWORDS))
            hint = (f"did you mean {near!r}?" if near else
                    f"it takes {', '.join(parameters)} (MoE settings in moe=MoEConfig(...))")
            raise SpecKeywordError(f"{function.__name__}() got an unknown keyword argument "
                                   f"{shown(key)!r}; {hint}")
    return nest_flat_settings(keywords)


def _warn_old_keywords(function: Callable, keywords: dict, new_form: str,
                       stacklevel: int = 4) -> None:
    """The FutureWarning of a call of `function` with old flat `keywords` (`stacklevel`: of the
    caller's frame, as `warnings.warn` counts from here)."""
    warnings.warn(
        f"{function.__name__}({', '.join(f'{key}=...' for key in keywords)}): flat MoE keywords "
        f"are deprecated and go in the next release; pass {shown(new_form, 300)} instead",
        FutureWarning, stacklevel=stacklevel)


def _with_old_keywords(function: Callable, config: Any, moe: Optional[MoEConfig],
                       keywords: dict) -> Optional[MoEConfig]:
    """`moe` with `function`'s old flat MoE `keywords` applied (to the TransformerConfig's MoE
    settings when `moe` is None, as those keywords were), with a FutureWarning naming the new
    form; `moe` itself without such keywords."""
    _check_moe(function, moe)
    if not keywords:
        return moe
    changes = _nested_changes(function, keywords)
    if moe is not None:
        _warn_old_keywords(function, keywords, f"moe=moe.merged({changes!r})")
        return moe.merged(changes, f"in the keywords of {function.__name__}")
    if config is None:
        called = ", ".join(f"{key}=..." for key in keywords)
        raise ConfigError(f"{function.__name__}({called}): flat MoE keywords change a "
                          "MoEConfig, and neither moe nor a TransformerConfig was "
                          f"given; pass moe=MoEConfig(...) (or moe=moe_config_from_transformer_"
                          f"config(config, {changes!r:.200}))")
    _warn_old_keywords(function, keywords,
                       f"moe=moe_config_from_transformer_config(config, {changes!r})")
    return moe_config_from_transformer_config(config, changes)


def transformer_engine_available() -> bool:
    """Transformer Engine is used only when it imports (it needs CUDA)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def moe_mlp_spec(moe: Optional[MoEConfig] = None, bias_width: Optional[int] = None,
                 step_owner: Optional[StepOwner] = None, **old_keywords: Any) -> ModuleSpec:
    """The `mlp` slot spec: a megamoe layer configured by `moe` (None: by the TransformerConfig
    it is built with), with the width of its expert-bias buffers
    (`megamoe.megatron.router_counts`) and who ends its steps (`megamoe.balancing.owner`; None:
    Megatron-LM's loop). `old_keywords`: flat MoE settings (`OLD_KEYWORDS`, deprecated) merged
    over `moe`."""
    moe = _with_old_keywords(moe_mlp_spec, None, moe, old_keywords)
    params = {name: value for name, value in (("moe", moe), ("bias_width", bias_width),
                                              ("step_owner", step_owner)) if value is not None}
    return ModuleSpec(module=MegatronMoELayer, params=params)


def _base_layer_spec(config: Any, moe: bool, use_te: bool) -> ModuleSpec:
    """Megatron's own GPT layer spec for `config`'s attention and norm settings (its MoE variant
    for MoE layers, which keeps a separate pre-MLP norm under Transformer Engine; with
    `multi_latent_attention`, its MLA layer, whose local variant gets megamoe's
    `LatentDotProductAttention`; with `qk_layernorm_scope` "projection", query and key norms
    over whole projections, `megamoe.megatron.projection_norm`; with attention sinks
    (`softmax_type`) or a sliding window (`window_size`), the local variant's core attention is
    megamoe's `SinkDotProductAttention`, Transformer Engine's reads them itself)."""
    mla = bool(getattr(config, "multi_latent_attention", False))
    spec = _megatron_layer_spec(moe, use_te, bool(getattr(config, "qk_layernorm", False)), mla,
                                getattr(config, "normalization", None),
                                getattr(config, "q_lora_rank", None) is not None)
    if not (use_te or mla) and (getattr(config, "softmax_type", "vanilla") != "vanilla"
                                or getattr(config, "window_size", None) is not None):
        spec = with_sink_attention(spec)
    return with_qk_norm_scope(spec, getattr(config, "qk_layernorm_scope", "head"))


@functools.lru_cache(maxsize=None)
def _megatron_layer_spec(moe: bool, use_te: bool, qk_layernorm: bool, mla: bool,
                         normalization: Optional[str], query_latent: bool) -> ModuleSpec:
    enable_local_fallbacks(LAYER_FALLBACKS)  # what these layers need without TE or apex
    kwargs = dict(qk_layernorm=qk_layernorm, multi_latent_attention=mla)
    if moe:
        kwargs.update(num_experts=2, moe_grouped_gemm=False)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(**kwargs)
    spec = get_gpt_layer_local_spec(normalization=normalization, **kwargs)
    return with_latent_attention(spec, query_latent) if mla else spec


def _uses_transformer_engine(config: Any, use_transformer_engine: Optional[bool]) -> bool:
    if use_transformer_engine is not None:
        return use_transformer_engine
    wanted = getattr(config, "transformer_impl", "transformer_engine") == "transformer_engine"
    return wanted and transformer_engine_available()


def gpt_layer_spec(config: Any = None, use_transformer_engine: Optional[bool] = None,
                   moe: Optional[MoEConfig] = None, bias_width: Optional[int] = None,
                   step_owner: Optional[StepOwner] = None, **old_keywords: Any) -> ModuleSpec:
    """A GPT TransformerLayer spec whose MLP is a megamoe layer (`moe_mlp_spec`).
    `old_keywords`: flat MoE settings (`OLD_KEYWORDS`, deprecated), merged over `moe`, or over
    the MoEConfig `config`'s MoE settings say."""
    moe = _with_old_keywords(gpt_layer_spec, config, moe, old_keywords)
    base = _base_layer_spec(config, moe=True,
                            use_te=_uses_transformer_engine(config, use_transformer_engine))
    submodules = dataclasses.replace(base.submodules,
                                     mlp=moe_mlp_spec(moe, bias_width, step_owner))
    return dataclasses.replace(base, submodules=submodules)


def gpt_decoder_block_spec(config: Any, moe: Optional[MoEConfig] = None, first_k_dense: int = 0,
                           layer_overrides: Optional[dict[int, Union[MoEConfig, dict]]] = None,
                           use_transformer_engine: Optional[bool] = None,
                           vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                           step_owner: Optional[StepOwner] = None,
                           **old_keywords: Any) -> TransformerBlockSubmodules:
    """Decoder block spec: dense layers and megamoe layers as `moe_layer_pattern` says.

    moe: the MoE layers' MoEConfig (None: mapped once from `config`'s MoE settings).
    layer_overrides: {layer index (0-based, global): that layer's MoEConfig, or nested changes
    merged over `moe` (`MoEConfig.merged`, e.g. {5: {"num_experts": 16, "topk": 4}})}.
    step_owner: who ends each step's balancing (`megamoe.balancing.owner`; None: Megatron-LM's
    loop). Only this pipeline stage's layers are returned, like Megatron's
    get_gpt_decoder_block_spec. `old_keywords`: flat MoE settings (`OLD_KEYWORDS`, deprecated),
    merged over `moe` (or what `config` says).
    """
    moe = _with_old_keywords(gpt_decoder_block_spec, config, moe, old_keywords)
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise ConfigError(
            "pipeline_model_parallel_layout is not supported by megamoe's block spec; use "
            "num_layers_in_first/last_pipeline_stage instead"
        )
    use_te = _uses_transformer_engine(config, use_transformer_engine)
    specs = _all_layer_specs(config, moe, first_k_dense, layer_overrides, use_te, step_owner)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    # The MoE layer spec's pre-MLP norm is a real norm under both backends (Transformer Engine's
    # dense spec fuses its norms into the linear layers).
    norm = gpt_layer_spec(config, use_te).submodules.pre_mlp_layernorm
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count], layer_norm=norm)


def mtp_block_spec(config: Any, moe: Optional[MoEConfig] = None,
                   layer_overrides: Optional[dict[int, Union[MoEConfig, dict]]] = None,
                   vp_stage: Optional[int] = None, pp_rank: Optional[int] = None,
                   step_owner: Optional[StepOwner] = None, first_k_dense: int = 0,
                   use_transformer_engine: Optional[bool] = None) -> Any:
    """The multi-token-prediction block spec of this pipeline (and virtual) stage, or None
    (no `mtp_num_layers`, or not the last stage): Megatron-Core's own MTP block
    (`get_gpt_mtp_block_spec`; DeepSeek-V3 tech report, arXiv 2412.19437, sec. 2.2), each
    depth's transformer layer of the last decoder layer's kind, as Megatron's MTP specs take it,
    so a MoE model's MTP layers are megamoe layers (balanced and tracked as the decoder's, under
    global layer numbers num_layers + k). Arguments as `gpt_decoder_block_spec`."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    use_te = _uses_transformer_engine(config, use_transformer_engine)
    last = _all_layer_specs(config, moe, first_k_dense, layer_overrides, use_te, step_owner)[-1]
    return get_gpt_mtp_block_spec(config, last, use_transformer_engine=use_te,
                                  vp_stage=vp_stage, pp_rank=pp_rank)


def _all_layer_specs(config: Any, moe: Optional[MoEConfig], first_k_dense: int,
                     layer_overrides: Optional[dict[int, Union[MoEConfig, dict]]], use_te: bool,
                     step_owner: Optional[StepOwner]) -> list[ModuleSpec]:
    """The layer spec of every decoder layer of the model (all pipeline stages)."""
    overrides = layer_overrides or {}
    pattern = moe_layer_pattern(config, first_k_dense)
    bad = sorted(i for i in overrides if not (0 <= i < len(pattern) and pattern[i]))
    if bad:
        raise ConfigError(f"layer_overrides for layers {bad}, which are not MoE layers")
    dense = _base_layer_spec(config, moe=False, use_te=use_te)
    base = moe if moe is not None else moe_config_from_transformer_config(config)
    layer_moe = {i: _layer_moe(base, overrides.get(i), i)
                 for i, is_moe in enumerate(pattern) if is_moe}
    # Every bias router of the model exposes buffers of the widest router's width, so that
    # Megatron's finalize_model_grads can stack them (megamoe.megatron.router_counts).
    width = max([cfg.num_experts for cfg in layer_moe.values()], default=None)
    return [gpt_layer_spec(config, use_te, layer_moe[i], width, step_owner) if is_moe else dense
            for i, is_moe in enumerate(pattern)]


def _layer_moe(base: MoEConfig, override: Union[MoEConfig, dict, None], layer: int) -> MoEConfig:
    """Layer `layer`'s MoEConfig: its own object, or its nested changes merged over `base` (flat
    settings of before the tree read as theirs, with a FutureWarning)."""
    if isinstance(override, MoEConfig):
        return override
    if isinstance(override, dict) and any(is_flat_setting(k, v) for k, v in override.items()):
        flat = [key for key, value in override.items() if is_flat_setting(key, value)]
        override = nest_flat_settings(override)
        warnings.warn(f"layer_overrides[{layer}] with flat MoE settings {flat}: deprecated, they "
                      f"go in the next release; write them nested: {shown(repr(override), 300)}",
                      FutureWarning, stacklevel=2)
    return base.merged(override, f"in layer_overrides[{layer}]") if override else base


class MegaMoETransformerLayer(TransformerLayer):
    """A TransformerLayer that is a megamoe MoE layer or Megatron's dense layer, decided when it
    is built from its TransformerConfig (`moe_layer_freq`, plus `first_k_dense`) and its global
    layer number, with Megatron's own attention and norm modules for that config.

    One ModuleSpec of it serves every layer, which is how Megatron-LM's `--spec` object is used:
    a MoE layer maps the `--moe-*` flags of the TransformerConfig it is built with into its
    MoEConfig (every layer of that config alike, so the expert-bias buffers need no padding).
    The global number is computed as TransformerLayer does (the pipeline/virtual-stage offset
    added to the block-local `layer_number`); a multi-token-prediction layer takes the kind of
    the last decoder layer, as Megatron's own MTP specs do.
    """

    def __init__(self, config: Any, submodules: Any = None, layer_number: int = 1,
                 first_k_dense: int = 0, moe_overrides: Optional[dict] = None, **kwargs: Any):
        number = _global_layer_number(config, layer_number, kwargs)
        # A multi-token-prediction layer (numbered after the decoder's) is of the last kind.
        is_moe = moe_layer_pattern(config, first_k_dense)[min(number, config.num_layers) - 1]
        use_te = _uses_transformer_engine(config, None)
        base = _base_layer_spec(config, moe=is_moe, use_te=use_te).submodules
        if is_moe:
            base = dataclasses.replace(
                base, mlp=moe_mlp_spec(moe_config_from_transformer_config(config, moe_overrides)))
        report_load_metrics()  # on dense-only pipeline stages too: every rank tracks alike
        super().__init__(config, base, layer_number, **kwargs)


def _global_layer_number(config: Any, layer_number: int, kwargs: dict) -> int:
    """1-based global layer number, as TransformerLayer computes `self.layer_number`, with a
    multi-token-prediction depth k after the decoder's layers (`compat.global_layer_number`)."""
    if kwargs.get("is_mtp_layer"):
        return global_layer_number(layer_number, config, True)
    if kwargs.get("add_layer_offset", True) is False:
        return layer_number
    pgs = kwargs.get("pg_collection")
    pp_group = getattr(pgs, "pp", None) if pgs is not None else \
        parallel_state.get_pipeline_model_parallel_group()
    offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"), get_pg_rank(pp_group))
    return layer_number + offset


class MegatronLMSpec(ModuleSpec):
    """A ModuleSpec of `MegaMoETransformerLayer` for Megatron-LM's `--spec` (used once per layer
    by TransformerBlock in every version). Called as a spec function, `spec(config)` or
    `spec(config, vp_stage=...)`, it returns `resolve(config, vp_stage)`; called any other way it
    builds the layer, as a ModuleSpec does."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and set(kwargs) <= {"vp_stage"}:
            return self.resolve(args[0], kwargs.get("vp_stage"))
        return build_module(self, *args, **kwargs)

    def resolve(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        """The spec for `config`: this layer spec itself."""
        return self


class MegatronLMBlockSpec(MegatronLMSpec):
    """`MegatronLMSpec` whose spec-function form returns the whole decoder block spec."""

    def resolve(self, config: Any, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
        """The decoder block spec of this pipeline (and virtual) stage for `config`, its MoE
        layers configured by the one MoEConfig `config`'s MoE settings map to."""
        overrides = self.params.get("moe_overrides")
        moe = moe_config_from_transformer_config(config, overrides) if overrides else None
        return gpt_decoder_block_spec(config, moe, vp_stage=vp_stage,
                                      first_k_dense=self.params["first_k_dense"])


def interleaved_layer_spec(first_k_dense: int = 0, block: bool = False,
                           moe_overrides: Optional[dict] = None,
                           **old_keywords: Any) -> MegatronLMSpec:
    """One spec for every layer: dense or megamoe MoE per `moe_layer_freq` and `first_k_dense`,
    decided at build time (`MegaMoETransformerLayer`), each MoE layer configured by the
    TransformerConfig's MoE settings with the nested `moe_overrides` merged over them
    (`moe_config_from_transformer_config`). With `block`, its spec-function form returns the
    decoder block spec. `old_keywords`: flat MoE settings (`OLD_KEYWORDS`, deprecated), merged
    into `moe_overrides`."""
    if old_keywords:
        changes = _nested_changes(interleaved_layer_spec, old_keywords)
        moe_overrides = deep_merge(moe_overrides or {}, changes)
        _warn_old_keywords(interleaved_layer_spec, old_keywords,
                           f"moe_overrides={moe_overrides!r}", stacklevel=3)
    cls = MegatronLMBlockSpec if block else MegatronLMSpec
    template = gpt_layer_spec(use_transformer_engine=transformer_engine_available())
    params: dict[str, Any] = {"first_k_dense": first_k_dense}
    if moe_overrides:
        params["moe_overrides"] = moe_overrides
    return cls(module=MegaMoETransformerLayer, submodules=template.submodules, params=params)


layer_spec = interleaved_layer_spec()
"""`pretrain_gpt.py --spec megamoe.megatron.specs layer_spec`: every layer dense or MoE as
`--moe-layer-freq` says, MoE settings from the `--moe-*` flags."""

decoder_block_spec = interleaved_layer_spec(block=True)
"""`pretrain_gpt.py --spec megamoe.megatron.specs decoder_block_spec`: the same layers; called
as a spec function (`decoder_block_spec(config, vp_stage=...)`) it returns the explicit decoder
block spec of that config's pipeline stage."""


__all__ = ["MegaMoETransformerLayer", "MegatronLMBlockSpec", "MegatronLMSpec", "OLD_KEYWORDS",
           "SpecKeywordError", "decoder_block_spec", "gpt_decoder_block_spec", "gpt_layer_spec",
           "interleaved_layer_spec", "layer_spec", "moe_layer_pattern", "moe_mlp_spec",
           "mtp_block_spec", "transformer_engine_available"]
