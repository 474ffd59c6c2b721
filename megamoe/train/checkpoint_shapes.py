"""Whether a checkpoint's weights fit the run's model: the settings that decide which tensors a
model has and their shapes, compared before Megatron-Core is asked to load anything.

`checkpoint.init_from` takes the weights of a checkpoint and may change every setting that
builds no other tensors (routing, balancing, dropout, a fine-tuning method's own modules, the
padding of the vocabulary). With another layer count, dense-layer pattern or expert size,
Megatron-Core's loader fails with its own words (`Different dict keys encountered in
apply_factory_merges`, a `CheckpointException` of ranks) or, with fewer layers, loads part of
the checkpoint; `check_weights_fit` names the first setting that differs instead, with the
checkpoint's value, the run's, and the fix.

A checkpoint records its model settings as the `model` and `moe` sections of a training config:
a megamoe training checkpoint's `config`, a converter's `megamoe_model` (tools/import_hf.py,
tools/upcycle_ckpt.py from a Hugging Face model). Megatron-LM's `args` (its checkpoints, and
tools/upcycle_ckpt.py's output from them) are compared by `check_megatron_lm_args`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from megamoe.checkpointing.layout import CONVERTED_MODEL_KEY
from megamoe.config import moe_layer_pattern, nest_flat_settings
from megamoe.errors import CheckpointError
from megamoe.settings import flat_values
from megamoe.train.checkpoint_schema import is_megamoe_state, saved_settings, upgraded
from megamoe.train.config import TrainConfig
from megamoe.train.megatron_lm_state import check_megatron_lm_args, is_megatron_lm_checkpoint

_MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
_EXPERT_SIZES = ("num_experts", "ffn_hidden_size", "shared_expert.ffn_hidden_size")


def check_weights_fit(common: dict, config: TrainConfig, path: Path) -> None:
    """Refuse, in one line naming the setting, both values and the fix, to load the weights of
    checkpoint `path` (common state `common`) into the model of `config` when the checkpoint
    records a model of other shapes. A checkpoint recording no settings passes (its load names
    the tensors that differ)."""
    sections = recorded_sections(common, path)
    if sections is None and not is_megamoe_state(common):
        if is_megatron_lm_checkpoint(common):
            check_megatron_lm_args(common, config, path)
        return
    saved = saved_settings(sections, path)
    for (name, old, old_shape), (run_name, new, new_shape) in zip(shape_settings(saved),
                                                                  shape_settings(config)):
        if old_shape != new_shape and old != new:
            name = run_name if "layer_overrides" in run_name else name
            raise CheckpointError(
                f"checkpoint {path} holds a model with {name}={old!r} but this run's config "
                f"says {new!r}; its weights load only into a model of the same shapes: set "
                f"{name}={old!r} (or train without checkpoint.init_from)")
    _check_mtp_layers(saved.model.mtp_layers, config.model.mtp_layers, path)


def _check_mtp_layers(saved: int, wanted: int, path: Path) -> None:
    """A run may take fewer multi-token-prediction layers than the checkpoint holds (the rest
    are left unread, as `--drop-mtp` does), not more: nothing would start the missing ones."""
    if wanted > saved:
        raise CheckpointError(
            f"checkpoint {path} holds {saved} multi-token-prediction layer(s) but this run's "
            f"config says model.mtp_layers={wanted}; its weights cannot start the missing ones: "
            f"set model.mtp_layers={saved} (or train without checkpoint.init_from)")


def recorded_sections(common: dict, path: Path) -> Any:
    """The `model` and `moe` sections (and whatever else) a checkpoint's common state records,
    in the current format: a megamoe training checkpoint's `config` upgraded from its format
    (`checkpoint_schema.upgraded`), a converter's `megamoe_model` with the flat MoE settings of
    older converters nested (`nest_flat_settings`); None when it records neither (or a
    training checkpoint's has none: corrupt). Their shape is not checked here."""
    if is_megamoe_state(common):
        return upgraded(common, path).get("config")
    sections = common.get(CONVERTED_MODEL_KEY)
    if isinstance(sections, dict) and isinstance(sections.get("moe"), dict):
        sections = {**sections, "moe": nest_flat_settings(sections["moe"])}
    return sections


def shape_settings(config: TrainConfig) -> list[tuple[str, Any, Any]]:
    """The settings of `config` that decide the model's tensors and their shapes, in order, as
    (name, value, what of the model it decides). Two configs build the same tensors when every
    entry decides the same; where one decides differently, the first entry whose value differs
    too names the setting (the MoE layer pattern is decided by `first_k_dense` and
    `moe_layer_freq` together, the expert MLP's shape by whether `experts.activation` is
    gated). A setting appears only where it builds a tensor (the MLA sizes with latent
    attention, the dense MLP with a dense layer, the MoE settings per MoE layer), and what an
    entry depends on is listed before it, so two configs' lists agree up to their first
    difference."""
    m = config.model
    heads = m.num_attention_heads
    items = [("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
             ("model.num_attention_heads", heads),
             ("model.multi_latent_attention", m.multi_latent_attention)]
    if m.multi_latent_attention:
        items += [(f"model.{key}", getattr(m, key)) for key in _MLA_SIZES]
    else:
        items += [("model.num_query_groups", m.num_query_groups or heads),
                  ("model.kv_channels", m.kv_channels or m.hidden_size // heads),
                  ("model.add_qkv_bias", m.add_qkv_bias), ("model.qk_layernorm", m.qk_layernorm)]
        if m.qk_layernorm:  # per-head or whole-projection norm weights (MiniMax-M2)
            items.append(("model.qk_layernorm_scope", m.qk_layernorm_scope))
    items += [("model.normalization", m.normalization),
              ("model.share_embeddings", m.share_embeddings),
              ("model.position_embedding", m.position_embedding)]
    if m.position_embedding == "learned_absolute":
        items.append(("model.seq_length", m.seq_length))
    pattern = moe_layer_pattern(m, m.first_k_dense)
    settings = [(name, value, value) for name, value in items]
    settings += [("model.first_k_dense", m.first_k_dense, pattern),
                 ("model.moe_layer_freq", m.moe_layer_freq, pattern)]
    if not all(pattern):
        settings += [(f"model.{key}", getattr(m, key), getattr(m, key))
                     for key in ("ffn_hidden_size", "swiglu")]
    for layer in (i for i, is_moe in enumerate(pattern) if is_moe):
        settings += _expert_settings(config, layer)
    return settings


def _expert_settings(config: TrainConfig, layer: int) -> list[tuple[str, Any, Any]]:
    """The MoE settings that shape MoE layer `layer`, named as its override where it has one."""
    moe = config.moe_config(layer)
    override = flat_values(config.moe.layer_overrides.get(layer, {}))
    values = flat_values(moe.to_dict())

    def setting(key: str, decides: Any = None) -> tuple[str, Any, Any]:
        name = f"moe.layer_overrides.{layer}.{key}" if key in override else f"moe.{key}"
        return name, values[key], values[key] if decides is None else decides

    settings = [setting(key) for key in _EXPERT_SIZES]
    if moe.shared_expert.ffn_hidden_size:
        settings.append(setting("shared_expert.gate"))
    settings.append(setting("experts.activation", moe.experts.gated))
    settings += [setting("experts.bias"), setting("router.bias")]  # GPT-OSS's biases
    return settings
