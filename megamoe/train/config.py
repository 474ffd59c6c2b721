"""The training run's configuration: `TrainConfig`, its checks across sections, and its loading
from YAML with `key=value` overrides.

A run is described by one YAML file with the sections below (every field has a default except
where noted; each section is a dataclass in `megamoe.train.settings` that validates itself) and
optional command-line overrides `section.field=value` (`output_dir=...` at the top level). Values
are parsed as YAML (`lr=3e-4`, `prefixes=[a,b]`) and read into the typed sections by
`megamoe.settings.build`: an unknown key, in the file or an override, is an error that names the
closest known key. The `moe` section is the MoE settings tree (`megamoe.config.MoEConfig`, its
`hidden_size` from `model`) plus `layer_overrides` (`megamoe.train.settings.moe`); the flat MoE
keys of older configs (`moe.router_type`, `moe.capacity_factor`, ...) are still read, each with
a one-line note on stderr naming its new key.

    output_dir: runs/tiny
    model:      {num_layers, hidden_size, num_attention_heads, ffn_hidden_size, seq_length, ...}
    moe:        {num_experts, ffn_hidden_size, topk, router: {kind, ...}, balancing: {...},
                 dispatcher: {...}, experts: {...}, shared_expert: {...}, layer_overrides}
    parallel:   {tensor, pipeline, virtual_stages, expert, first/last_stage_layers}
    data:       {prefixes, weights, tokenizer, cache_dir, split, ...}
    training:   {train_steps, micro_batch_size, global_batch_size, seed, precision, ...}
    optimizer:  {lr, min_lr, warmup_steps, decay_style, weight_decay, ...}
    checkpoint: {interval, dir, init_from, keep_last, resume_from_verified, ...}
    logging:    {interval, tensorboard, wandb, ...}
    guards:     {nonfinite, spike_factor, spike_window, spike_action, max_rollbacks}
    evaluation: {interval, batches}
    finetune:   {method, train_data, eval_data, eval_interval, lora_rank, simoe, ...}
"""
from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megamoe.bounded import (MAX_INT_DIGITS, check_structure, load_yaml, parse_yaml,
                             read_bounded)
from megamoe.config import MoEConfig, moe_layer_pattern
from megamoe.errors import ConfigError
from megamoe.settings import (brief, build, check_fields, coerce, dotted_keys, shown,
                              unknown_key)
from megamoe.train.methods import PRETRAINING, training_method
from megamoe.train.settings.checkpoint import CheckpointConfig
from megamoe.train.settings.checks import require
from megamoe.train.settings.data import DataConfig, split_weights
from megamoe.train.settings.evaluation import EvaluationConfig
from megamoe.train.settings.finetune import FinetuneConfig
from megamoe.train.settings.guards import GuardsConfig
from megamoe.train.settings.logging import LoggingConfig
from megamoe.train.settings.model import YARN_FLAGS, YARN_KEYS, ModelConfig, yarn_settings
from megamoe.train.settings.moe import (MoESection, Note, flat_path, moe_keys, nest_moe_section,
                                        read_moe_section)
from megamoe.train.settings.optimizer import OptimizerConfig
from megamoe.train.settings.parallel import ParallelConfig
from megamoe.train.settings.sizes import check_model_size
from megamoe.train.settings.training import TrainingConfig

__all__ = ["TrainConfig", "ModelConfig", "MoESection", "ParallelConfig", "DataConfig",
           "TrainingConfig", "OptimizerConfig", "CheckpointConfig", "LoggingConfig",
           "GuardsConfig", "EvaluationConfig", "FinetuneConfig", "yarn_settings",
           "split_weights", "check_across", "known_keys", "coerce_fields", "config_from_dict",
           "parse_override", "apply_overrides", "load_config", "dump_config"]

MAX_CONFIG_BYTES = 1 << 20
"""A config file larger than this (1 MiB) is refused unread."""
MAX_CONFIG_VALUES = 100_000
"""A config (or override) holding more values than this, YAML aliases expanded, is refused."""
KEY_ALIASES = {"data.tokenizer_model": "data.tokenizer"}
"""Keys older configs wrote -> the key that reads them now."""
_HELP = "see megamoe/train/settings/"


@dataclass(kw_only=True)
class TrainConfig:
    """A whole training run."""

    output_dir: str = "runs/default"
    """Metrics, TensorBoard, the resolved config and (by default) checkpoints go here."""
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoESection
    """The MoE layers' settings tree (`moe.num_experts` and `moe.ffn_hidden_size` are required)
    and `layer_overrides: {layer index (0-based): nested MoE settings}`."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def __post_init__(self) -> None:
        check_fields(self)  # each section an instance of its class or a mapping of its settings

    @property
    def checkpoint_dir(self) -> Path:
        """Where this run's checkpoints and `latest` marker live."""
        return Path(self.checkpoint.dir or Path(self.output_dir) / "checkpoints")

    def moe_config(self, layer: Optional[int] = None) -> MoEConfig:
        """The MoEConfig of MoE layers (with layer `layer`'s overrides, if given)."""
        return self.moe.layer(layer)

    def to_dict(self) -> dict:
        """Plain nested data (what `dump_config` writes and checkpoints store; no
        `moe.hidden_size`, which is `model.hidden_size`)."""
        data = dataclasses.asdict(self)
        del data["moe"]["hidden_size"]
        return data


_SECTIONS = [f.name for f in dataclasses.fields(TrainConfig)]


def check_across(config: TrainConfig) -> None:
    """The checks that span sections (each section checks its own fields when it is built):
    what tensor ranks split, the pipeline's stages, MLA's recomputation, evaluation's split,
    what multi-token prediction cannot train with, the training method's demands, the MoE
    layers' overrides and expert parallelism, and the model's sizes."""
    m, p = config.model, config.parallel
    for key, value in [("model.num_attention_heads", m.num_attention_heads),
                       ("model.num_query_groups", m.num_query_groups)]:
        require(value is None or value % p.tensor == 0,
                f"{key}={value} is not divisible by parallel.tensor={p.tensor} (tensor ranks "
                "split the attention heads); pick a tensor size that divides it")
    require(m.seq_length % p.tensor == 0,
            f"model.seq_length={m.seq_length} is not divisible by parallel.tensor={p.tensor} "
            "(sequence parallelism splits each sequence over tensor ranks); pick a length the "
            "tensor size divides")
    is_moe = moe_layer_pattern(m, m.first_k_dense)
    require(all(is_moe) or m.ffn_hidden_size % p.tensor == 0,
            f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tensor="
            f"{p.tensor} (tensor ranks split the MLP of the dense layers); pick a tensor size "
            "that divides it")
    if m.multi_latent_attention:
        down = [("model.kv_lora_rank + model.qk_pos_emb_head_dim",
                 m.kv_lora_rank + m.qk_pos_emb_head_dim)]
        down += [("model.q_lora_rank", m.q_lora_rank)] if m.q_lora_rank is not None else []
        for key, value in down:
            require(value % p.tensor == 0, f"{key}={value} is not divisible by parallel.tensor="
                    f"{p.tensor} (MLA's down projections are split over tensor ranks)")
    require(m.multi_latent_attention or "mla_up_proj" not in config.training.recompute_modules,
            "training.recompute_modules has 'mla_up_proj', which needs "
            "model.multi_latent_attention=true; drop it")
    _check_uneven_stages(config)
    _check_evaluation(config)
    _check_multi_token_prediction(config)
    method = training_method(config.finetune.method)
    if method is not None:
        method.check(config)
    for layer in config.moe.layer_overrides:
        require(layer < m.num_layers, f"moe.layer_overrides names layer {layer}, outside "
                f"0..{m.num_layers - 1}")
    for layer in [None, *config.moe.layer_overrides]:
        config.moe_config(layer).check_expert_parallel(p.expert)
    check_model_size(config.model, config.moe, config.data, config.training)


def _check_multi_token_prediction(config: TrainConfig) -> None:
    """`model.mtp_layers` with what Megatron-Core's MTP block or megamoe cannot train with it."""
    m, p = config.model, config.parallel
    if not m.mtp_layers:
        return
    require(config.finetune.method == PRETRAINING,
            f"model.mtp_layers={m.mtp_layers} cannot be combined with finetune.method="
            f"{config.finetune.method}, whose model has no multi-token prediction; set "
            "model.mtp_layers=0")
    require(m.position_embedding != "learned_absolute" or p.pipeline == 1,
            f"model.mtp_layers={m.mtp_layers} with model.position_embedding=learned_absolute "
            f"at parallel.pipeline={p.pipeline}: the last stage's multi-token prediction would "
            "train its own copy of the position embeddings; use model.position_embedding=rope "
            "or parallel.pipeline=1")


def _check_uneven_stages(config: TrainConfig) -> None:
    """`parallel.first/last_stage_layers`: the stages they size, the rest of `num_layers` split
    evenly over the middle stages, every stage's layers over the virtual stages (Megatron-Core's
    rule for uneven pipelines, checked here so it is a one-line error, not a traceback)."""
    p, layers = config.parallel, config.model.num_layers
    given = {key: value for key, value in [("parallel.first_stage_layers", p.first_stage_layers),
                                           ("parallel.last_stage_layers", p.last_stage_layers)]
             if value is not None}
    if not given:
        return
    sizes = ", ".join(f"{key}={value}" for key, value in given.items())
    middle_stages, middle_layers = p.pipeline - len(given), layers - sum(given.values())
    require(middle_stages >= 0 and middle_layers >= 0 and
            (middle_stages == 0) == (middle_layers == 0) and
            (middle_stages == 0 or middle_layers % middle_stages == 0),
            f"{sizes} leave {middle_layers} of model.num_layers={layers} for "
            f"{max(middle_stages, 0)} middle stage(s) of parallel.pipeline={p.pipeline}; the "
            "middle stages must share the rest evenly (or set these null)")
    per_stage = [*given.values(), *([middle_layers // middle_stages] if middle_stages else [])]
    require(all(n % p.virtual_stages == 0 for n in per_stage),
            f"{sizes} with parallel.virtual_stages={p.virtual_stages}: every stage's layers "
            f"({per_stage}) must split evenly over the virtual stages")


def _check_evaluation(config: TrainConfig) -> None:
    """Held-out evaluation needs a valid split and runs the model on one pipeline stage."""
    interval, split = config.evaluation.interval, config.data.split
    require(interval == 0 or split_weights(split)[1] > 0,
            f"evaluation.interval={interval} needs a valid split, but data.split={split!r} "
            "holds out no documents; set e.g. data.split=95,5,0")
    require(interval == 0 or config.parallel.pipeline == 1,
            f"evaluation.interval={interval} runs the model on one pipeline stage; set "
            f"parallel.pipeline=1 (got {config.parallel.pipeline}) or evaluation.interval=0")


def known_keys() -> list[str]:
    """Every dotted key a config may set (each section of the MoE tree included; the keys of
    MoE layer overrides and of `finetune.simoe` excepted)."""
    hints = typing.get_type_hints(TrainConfig)
    keys = []
    for name in _SECTIONS:
        if name == "moe":
            keys += moe_keys("moe") + ["moe.layer_overrides"]
        elif dataclasses.is_dataclass(hints[name]):
            keys += dotted_keys(hints[name], name)
            keys += [f"model.yarn.{k}" for k in (*YARN_KEYS, *YARN_FLAGS)] if name == "model" \
                else []
        else:
            keys.append(name)
    return keys


def coerce_fields(kind: Any, raw: dict, prefix: str) -> dict:
    """`raw`'s values as the types of dataclass `kind`'s fields of the same names (a value that
    is not is a ConfigError naming `prefix.key`)."""
    hints = typing.get_type_hints(kind)
    return {key: coerce(value, hints[key], f"{prefix}.{key}") for key, value in raw.items()}


class _Notes:
    """A `note(old, new)` that collects the notes of flat keys; `show` prints each once, on
    stderr, on rank 0 (the rank torchrun gives the process; all of them read alike), once the
    config has been read, so a config that fails shows its one error line alone."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, old: str, new: str) -> None:
        line = f"note: {old} is now {new} (read as that)"
        if line not in self.lines:
            self.lines.append(line)

    def show(self) -> None:
        if os.environ.get("RANK", "0") == "0":
            for line in self.lines:
                print(line, file=sys.stderr, flush=True)
        self.lines.clear()


def _resolve_aliases(raw: dict, where: str) -> dict:
    """`raw` with each `KEY_ALIASES` key moved to the key it stands for (both given: an
    error, unless they agree)."""
    for alias, key in KEY_ALIASES.items():
        section, old = alias.split(".")
        new = key.split(".")[1]
        values = raw.get(section)
        if isinstance(values, dict) and old in values:
            values = dict(values)
            value = values.pop(old)
            if new in values and values[new] != value:
                raise ConfigError(f"{alias}={brief(value)} and {key}={brief(values[new])} "
                                  f"{where} disagree; {alias} is the older name of {key}: keep "
                                  "only one")
            raw = {**raw, section: {**values, new: value}}
    return raw


def config_from_dict(raw: Any, where: str = "in the config",
                     note: Optional[Note] = None) -> TrainConfig:
    """Build and validate a TrainConfig from nested plain data (a parsed YAML document); the
    older key names of `KEY_ALIASES` and the flat MoE keys are read as their new names (`note`:
    what is told of the latter; default: a note line on stderr)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the config {where} must be a mapping of sections, not {brief(raw)}")
    raw = _resolve_aliases(raw, where)
    for name in raw:
        if name not in _SECTIONS:
            raise unknown_key(name, where, _SECTIONS + known_keys(), _HELP)
    hints = typing.get_type_hints(TrainConfig)
    values: dict[str, Any] = {}
    notes = _Notes() if note is None else note
    for name in _SECTIONS:
        value = raw.get(name)
        if name == "moe":
            values[name] = read_moe_section(value, values["model"], where, notes)
        elif dataclasses.is_dataclass(hints[name]):
            values[name] = build(hints[name], {} if value is None else value, name, where)
        elif name in raw:
            values[name] = coerce(value, hints[name], name)
    config = TrainConfig(**values)
    check_across(config)
    if note is None:
        notes.show()
    return config


def parse_override(text: str) -> tuple[list, Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML; a part of digits is an int)."""
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not key=value, e.g. training.train_steps=20")
    what = f"override '{shown(text)}'"
    try:
        parsed = load_yaml(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    except ValueError as err:  # nesting or an integer beyond Python's limits
        raise ConfigError(f"{what} {err}") from None
    check_structure(parsed, ConfigError, what, MAX_CONFIG_VALUES)
    path = [int(p) if p.isascii() and p.isdigit() and len(p) <= MAX_INT_DIGITS else p
            for p in key.split(".")]
    return path, parsed


def _tree_path(path: list, value: Any, note: Note) -> list:
    """`path` of an override, a flat MoE key of an older config (`moe.router_type`, also in a
    layer's overrides) replaced by its key in the tree (told to `note`)."""
    if path[0] != "moe":
        return path
    head = path[:3] if path[1:2] == ["layer_overrides"] else path[:1]
    new = flat_path(path[len(head):], value)
    if new is None:
        return path
    note(".".join(map(str, path)), ".".join(map(str, head + new)))
    return head + new


def _check_override_path(path: list, text: str) -> None:
    """Reject an override of an unknown key before merging, so the message names the override."""
    where = f"in override '{shown(text)}'"
    dotted = ".".join(map(str, path))
    if path[:2] == ["moe", "layer_overrides"]:
        candidates = moe_keys(".".join(map(str, path[:3])))
        if len(path) > 3 and dotted not in candidates:
            raise unknown_key(dotted, where, candidates, _HELP)
        return
    if path[:2] == ["finetune", "simoe"] and len(path) == 3:
        return  # SIMoE's own fields: the simoe finetuning method checks their names
    if dotted not in known_keys():
        raise unknown_key(dotted, where, known_keys(), _HELP)


def apply_overrides(raw: dict, overrides: list[str], note: Optional[Note] = None) -> dict:
    """A copy of `raw` with each `key=value` override set (dotted keys reach into sections; an
    override of either name of an aliased or flat MoE key replaces the file's value)."""
    notes = _Notes() if note is None else note
    merged = yaml.safe_load(yaml.safe_dump(raw)) if raw else {}
    merged = _resolve_aliases(merged, "in the config")
    if isinstance(merged.get("moe"), dict):
        merged["moe"] = nest_moe_section(merged["moe"], notes)
    for text in overrides:
        path, value = parse_override(text)
        alias = KEY_ALIASES.get(".".join(map(str, path)))
        path = _tree_path(alias.split(".") if alias else path, value, notes)
        _check_override_path(path, text)
        node = merged
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    if note is None:
        notes.show()
    return merged


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """Read the YAML config at `path`, apply `overrides`, validate, return the TrainConfig."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {shown(path)} does not exist; pass e.g. "
                          "configs/tiny_cpu.yaml")
    what = f"config file {shown(path)}"
    raw = parse_yaml(read_bounded(path, MAX_CONFIG_BYTES, ConfigError, what), ConfigError,
                     what, MAX_CONFIG_VALUES) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {shown(path)} must hold a mapping of sections")
    notes = _Notes()
    # Unknown keys in the file are reported against the file, those of overrides against them.
    config_from_dict(raw, f"in {path}", notes)
    config = config_from_dict(apply_overrides(raw, list(overrides), notes), "after the overrides",
                              notes)
    notes.show()
    return config


def dump_config(config: TrainConfig) -> str:
    """The config as YAML text that `load_config` reads back to an equal config."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
