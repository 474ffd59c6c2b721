"""The `moe` section: the MoE layers' settings tree (`megamoe.config.MoEConfig`) as a training
config writes it, with per-layer overrides.

    moe:
      num_experts: 8
      ffn_hidden_size: 256
      router: {kind: topk, score_function: sigmoid}
      balancing: {methods: [bias], bias_update_rate: 1.0e-3}
      layer_overrides: {3: {num_experts: 16, router: {kind: top_p}}}

`hidden_size` is `model.hidden_size` (the section refuses its own); unless given,
`experts.activation` is SwiGLU or GELU as `model.swiglu` says and `init_method_std` is
`model.init_method_std`, what Megatron's TransformerConfig gives the layer. The flat keys of
older configs (`router_type`, `balancing: bias`, `capacity_factor`, in the section and in each
layer's overrides) are read through `megamoe.config.FLAT_NAMES`, each with a note.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megamoe.config import FLAT_NAMES, MoEConfig, is_flat_setting, nest_flat_settings
from megamoe.errors import ConfigError
from megamoe.settings import brief, build, deep_merge, dotted_keys, model_setting
from megamoe.train.settings.checks import require
from megamoe.train.settings.model import ModelConfig

Note = Callable[[str, str], None]
"""`note(old_key, new_key)`: a flat key of an older config was read as its place in the tree."""


@dataclass
class MoESection(MoEConfig):
    """MoEConfig of the model's MoE layers, with `hidden_size` from the `model` section, and the
    overrides of single layers."""

    layer_overrides: dict[int, dict] = model_setting(default_factory=dict)
    """{layer index (0-based): nested MoE settings}, deep-merged over this section's for that
    layer (`megamoe.settings.deep_merge`: a router of another kind replaces the router section).
    Metrics number layers from 1, as Megatron's layer_number: index 2 is `moe/layer3`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for layer, changes in self.layer_overrides.items():
            require(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0
                    and isinstance(changes, dict), f"moe.layer_overrides entry {brief(layer)}: "
                    f"{brief(changes)} must be `<layer index>: {{<MoE setting>: value}}`")
            _refuse_hidden_size(changes, f"moe.layer_overrides.{layer}")
            self.layer(layer)  # the merged settings validate themselves

    def layer(self, index: Optional[int] = None) -> MoEConfig:
        """The MoEConfig of layer `index` (its overrides deep-merged over the section's), or of
        the section itself (None, or a layer without overrides)."""
        prefix = "moe" if index not in self.layer_overrides else f"moe.layer_overrides.{index}"
        return build(MoEConfig, deep_merge(self._settings(), self.layer_overrides.get(index, {})),
                     prefix)

    def _settings(self) -> dict:
        """The section's own MoE settings as plain data (`hidden_size` included)."""
        return {name: value for name, value in dataclasses.asdict(self).items()
                if name != "layer_overrides"}


def read_moe_section(raw: Any, model: ModelConfig, where: str, note: Note) -> MoESection:
    """The `moe` section from plain data (see the module docstring); `note` is called for each
    flat key of an older config."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"section 'moe' {where} must be a mapping, not {brief(raw)}")
    overrides = raw.get("layer_overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"moe.layer_overrides {where} must map layer indices to MoE settings, "
                          f"not {brief(overrides)}")
    settings = nest_moe_section(raw, note)
    experts = settings.get("experts", {})
    if isinstance(experts, dict) and "activation" not in experts:
        settings["experts"] = {**experts, "activation": "swiglu" if model.swiglu else "gelu"}
    settings.setdefault("init_method_std", model.init_method_std)
    return build(MoESection, {**settings, "hidden_size": model.hidden_size}, "moe", where)


def nest_moe_section(raw: dict, note: Note) -> dict:
    """The `moe` section's plain data `raw` with each flat key of an older config, in the section
    and in each layer's overrides, moved to its place in the tree
    (`megamoe.config.nest_flat_settings`); `hidden_size` is refused in both."""
    def nested(settings: dict, prefix: str) -> dict:
        _refuse_hidden_size(settings, prefix)
        return nest_flat_settings(settings,
                                  lambda old, new: note(f"{prefix}.{old}", f"{prefix}.{new}"))

    section = nested({k: v for k, v in raw.items() if k != "layer_overrides"}, "moe")
    overrides = raw.get("layer_overrides")
    if isinstance(overrides, dict):
        section["layer_overrides"] = {
            layer: nested(changes, f"moe.layer_overrides.{layer}")
            if isinstance(changes, dict) else changes for layer, changes in overrides.items()}
    return section


def flat_path(path: list, value: Any) -> Optional[list[str]]:
    """The path in the tree of MoE setting `path` (below `moe` or a layer's overrides) set to
    `value`, when it is a flat key of an older config (None otherwise)."""
    if len(path) == 1 and is_flat_setting(path[0], value):
        return FLAT_NAMES[path[0]].split(".")
    return None


def moe_keys(prefix: str = "moe") -> list[str]:
    """Every dotted key of the MoE settings tree under `prefix` (each section and its settings,
    those of every registered router and dispatcher), `hidden_size` excepted."""
    return [key for key in dotted_keys(MoEConfig, prefix) if key != f"{prefix}.hidden_size"]


def _refuse_hidden_size(raw: dict, prefix: str) -> None:
    require("hidden_size" not in raw, f"{prefix}.hidden_size={brief(raw.get('hidden_size'))} "
            "cannot be set: the MoE layers' width is model.hidden_size; set that instead")
