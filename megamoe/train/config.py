"""The training run's configuration: schema, YAML loading, `key=value` overrides, validation.

A run is described by one YAML file with the sections below (every field has a default except
where noted) and optional command-line overrides `section.field=value` (`output_dir=...` at the
top level). Values are parsed as YAML (`lr=3e-4`, `prefixes=[a,b]`) and checked against the
field's type. An unknown key, in the file or an override, is an error that names the closest
known key. The `moe` section takes any `megamoe.MoEConfig` field (except `hidden_size`, which
comes from `model`) plus `layer_overrides: {layer index: {MoEConfig fields}}`, and is validated by
building the MoEConfig.

    output_dir: runs/tiny
    model:      {num_layers, hidden_size, num_attention_heads, ffn_hidden_size, seq_length, ...}
    moe:        {num_experts, ffn_hidden_size, topk, balancing, ..., layer_overrides}
    parallel:   {tensor, pipeline, virtual_stages, expert, first/last_stage_layers}
    data:       {prefixes, weights, tokenizer, cache_dir, split, ...}
    training:   {train_steps, micro_batch_size, global_batch_size, seed, precision, ...}
    optimizer:  {lr, min_lr, warmup_steps, decay_style, weight_decay, ...}
    checkpoint: {interval, dir, init_from, keep_last, resume_from_verified, ...}
    logging:    {interval, tensorboard, wandb, ...}
    guards:     {nonfinite, spike_factor, spike_window, spike_action, max_rollbacks, debug_*}
    evaluation: {interval, batches}
    finetune:   {method, train_data, eval_data, eval_interval, lora_rank, simoe, ...}
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import reprlib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from megamoe.bounded import (MAX_INT_DIGITS, check_structure, load_yaml, parse_yaml,
                             read_bounded)
from megamoe.config import MoEConfig, moe_layer_pattern
from megamoe.errors import ConfigError, one_line
from megamoe.train.methods import training_method

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
RECOMPUTE = ("none", "full", "selective")
# Megatron-Core's selective recompute modules that apply to megamoe's GPT (no Megatron MoE
# layers): `mlp` recomputes dense MLPs and megamoe's MoE layers, `moe` the latter, `mla_up_proj`
# multi-head latent attention's up projections and RoPE.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "mla_up_proj")
YARN_KEYS = {"factor": None, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""`model.yarn`'s settings and their defaults (None: required)."""
DECAY_STYLES = ("cosine", "linear", "constant")
SPIKE_ACTIONS = ("stop", "rollback")
MAX_CONFIG_BYTES = 1 << 20
"""A config file larger than this (1 MiB) is refused unread."""
MAX_CONFIG_VALUES = 100_000
"""A config (or override) holding more values than this, YAML aliases expanded, is refused."""
MAX_INT = 2 ** 63 - 1
"""The largest magnitude of an integer setting (what torch and Megatron can hold)."""
_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 60
_BRIEF.maxlist = _BRIEF.maxdict = 4
_BRIEF.maxlevel = 2


@dataclass
class ModelConfig:
    """The GPT architecture (Megatron-Core GPTModel) around the MoE layers."""

    num_layers: int = 4
    """Transformer layers."""
    hidden_size: int = 128
    """Model width D."""
    num_attention_heads: int = 4
    """Attention heads."""
    num_query_groups: Optional[int] = None
    """Grouped-query attention: key/value heads (None: one per attention head)."""
    ffn_hidden_size: int = 512
    """MLP size of the dense (non-MoE) layers."""
    seq_length: int = 128
    """Tokens per training sample."""
    normalization: str = "RMSNorm"
    """`RMSNorm` or `LayerNorm`."""
    position_embedding: str = "learned_absolute"
    """`learned_absolute` or `rope` (rotary position embedding, arXiv 2104.09864)."""
    rotary_base: float = 10000.0
    """RoPE base period (Llama 3: 500000, Qwen2: 1000000; a fractional one is kept as it is)."""
    rope_scaling_factor: Optional[float] = None
    """Llama 3.1's RoPE frequency scaling with this factor (Megatron-Core's `rope_scaling`:
    low/high frequency factors 1 and 4, original context 8192); None: no scaling."""
    kv_channels: Optional[int] = None
    """Attention head dimension (None: hidden_size / num_attention_heads)."""
    add_qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the RMSNorm/LayerNorm denominators (Qwen2: 1e-6)."""
    swiglu: bool = True
    """Dense MLPs (and, unless `moe.activation` says otherwise, experts) use SwiGLU."""
    qk_layernorm: bool = False
    """Normalise queries and keys before attention (always on with
    `multi_latent_attention`: its query and key-value latents are RMS-normalised)."""
    multi_latent_attention: bool = False
    """Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, sec. 2.1): queries
    and keys/values through normalised low-rank latents, RoPE on a decoupled part of each
    query and key head (Megatron-Core's MLASelfAttention). Needs `position_embedding: rope`
    (its `rotary_base` applies) and one key-value head per attention head."""
    q_lora_rank: Optional[int] = None
    """MLA: rank of the query latent (DeepSeek-V3: 1536); None: queries projected from the
    hidden state directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """MLA: rank of the key-value latent (DeepSeek-V2/V3: 512)."""
    qk_head_dim: int = 128
    """MLA: query/key head dimension without RoPE."""
    qk_pos_emb_head_dim: int = 64
    """MLA: query/key head dimension that carries RoPE (the key part is shared by all heads);
    the softmax scale is 1/sqrt(qk_head_dim + qk_pos_emb_head_dim)."""
    v_head_dim: int = 128
    """MLA: value head dimension."""
    yarn: dict = field(default_factory=dict)
    """MLA: YaRN context extension of its RoPE (arXiv 2309.00071), as DeepSeek-V2/V3 set it:
    `{factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}`
    (defaults: factor required, 4096, 32, 1, 1, 0); empty: plain RoPE."""
    share_embeddings: bool = False
    """Tie the input embedding and the output layer."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    first_k_dense: int = 0
    """The first k layers have a dense MLP instead of experts (DeepSeek-V3 uses 3)."""
    moe_layer_freq: Union[int, list[int]] = 1
    """MoE layer pattern: every n-th layer, or a 0/1 list with one entry per layer."""
    make_vocab_size_divisible_by: int = 128
    """Pad the tokenizer's vocabulary to a multiple of this (times tensor-parallel size)."""


@dataclass
class ParallelConfig:
    """Megatron-Core parallel sizes; data parallelism takes the remaining ranks."""

    tensor: int = 1
    """Tensor-parallel size (sequence parallelism is switched on when > 1). Context parallelism
    is not offered: Megatron-Core's local attention refuses it, only Transformer Engine's
    attention implements it."""
    pipeline: int = 1
    """Pipeline-parallel size."""
    virtual_stages: int = 1
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B when > 1; `num_layers` must
    split evenly over pipeline x virtual_stages chunks)."""
    expert: int = 1
    """Expert-parallel size: the experts of each MoE layer are split over this many ranks."""
    first_stage_layers: Optional[int] = None
    """Pipeline: layers of the first stage when `num_layers` does not split evenly (the middle
    stages share the rest equally)."""
    last_stage_layers: Optional[int] = None
    """Pipeline: layers of the last stage (see `first_stage_layers`)."""


@dataclass
class DataConfig:
    """Training data: Megatron indexed datasets, or the built-in default corpus."""

    prefixes: list[str] = field(default_factory=list)
    """PREFIX of PREFIX.bin/.idx files (tools/preprocess_data.py); empty: the default corpus
    (Python standard library prose, built once under `cache_dir`)."""
    weights: Optional[list[float]] = None
    """Blend weights, one per prefix (None: one pass over each)."""
    tokenizer: Optional[str] = None
    """The tokenizer of the data (megamoe.train.tokenizer.load_tokenizer): a SentencePiece
    `.model`, a Hugging Face `tokenizer.json` or a folder holding one. Required with `prefixes`
    (whose `PREFIX.tokenizer-identity.json` it must match); without `prefixes` the default corpus
    is tokenized with it. `data.tokenizer_model` (older configs) is read as this key."""
    cache_dir: str = "~/.cache/megamoe"
    """Where the default corpus and the dataset index caches live (shared by all ranks)."""
    split: str = "100,0,0"
    """train/valid/test document split weights."""
    vocab_size: int = 4096
    """Vocabulary size. Without `tokenizer`: the size the default corpus's tokenizer is trained
    to. With `tokenizer` the trainer takes the tokenizer's own size (or the embedding rows of
    the checkpoint it starts from, when they are more), and this value says
    what that size is where the tokenizer is not at hand: the memory planner
    (`tools/plan_memory.py`) counts the embedding and output layer with it (the recipes set
    their model's vocabulary here)."""
    num_workers: int = 0
    """Data loader worker processes per rank."""
    eod_mask_loss: bool = False
    """Megatron's eod_mask_loss: positions whose input is the end-of-document token do not count
    in the loss (the next document's first token is not predicted across the boundary). Off,
    every position counts, the end of each document included, whatever the tokenizer's pad."""


@dataclass
class TrainingConfig:
    """Steps, batch sizes, precision, device."""

    train_steps: int = 100
    """Optimizer steps of the whole run (a resumed run continues up to this count)."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all data-parallel ranks (gradient accumulation makes up
    the rest)."""
    seed: int = 1234
    """Seed of weight initialisation, dropout and data order."""
    precision: str = "auto"
    """`auto` (bf16 on CUDA, fp32 on CPU), `fp32` or `bf16`."""
    device: str = "auto"
    """`auto` (CUDA when available), `cpu` or `cuda`."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    recompute: str = "none"
    """Activation recomputation: `none`, `full` (every transformer layer) or `selective` (the
    `recompute_modules` of each layer)."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn", "mlp"])
    """With `recompute: selective`, Megatron-Core's recompute modules (`core_attn`,
    `layernorm`, `mlp`: dense MLPs and megamoe MoE layers, `moe`: megamoe MoE layers only,
    `mla_up_proj`: MLA's up projections and RoPE)."""
    exit_interval: int = 0
    """Save and exit 0 whenever the step count is a multiple of this (0: never), so a long run
    proceeds in chunks (a rerun of the same command resumes); as Megatron-LM's --exit-interval."""
    collective_timeout_s: float = 600.0
    """A collective waiting longer than this (a dead rank) fails instead of hanging."""


@dataclass
class OptimizerConfig:
    """AdamW with linear warm-up and decay to `min_lr`."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to `lr`."""
    decay_style: str = "cosine"
    """`cosine`, `linear` or `constant` after warm-up."""
    decay_steps: Optional[int] = None
    """Steps of decay after warm-up (None: until `train_steps`)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""


@dataclass
class CheckpointConfig:
    """Megatron-Core distributed checkpoints (torch_dist)."""

    interval: int = 0
    """Save every this many steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    dir: Optional[str] = None
    """Checkpoint folder (None: OUTPUT_DIR/checkpoints). A run resumes from the checkpoint its
    `latest_checkpointed_iteration.txt` names."""
    init_from: Optional[str] = None
    """Start a new run from these model weights (e.g. tools/upcycle_ckpt.py output); ignored
    when the run resumes from its own checkpoint."""
    keep_last: int = 2
    """Keep this many newest checkpoints (0: keep all); the newest checkpoint that verified
    before the run started is kept as well."""
    resume_from_verified: bool = False
    """When the tracker's checkpoint is missing or fails its checksums, resume from the newest
    checkpoint that verifies instead of stopping with an error."""
    allow_other_tokenizer: bool = False
    """Train the weights of `init_from` or of the resumed checkpoint on data of a tokenizer
    other than the one the checkpoint records (its fingerprint differs), e.g. after changing
    the vocabulary on purpose. Off, such a run is refused before it trains: the model would
    learn token ids that mean something else."""


@dataclass
class LoggingConfig:
    """Console, JSONL, TensorBoard and wandb metrics."""

    interval: int = 10
    """Print and log every this many steps (the JSONL file gets every step)."""
    tensorboard: bool = True
    """Write TensorBoard events to OUTPUT_DIR/tensorboard (when tensorboard is installed)."""
    wandb: bool = False
    """Log to Weights & Biases: online with WANDB_API_KEY set, else offline into OUTPUT_DIR."""
    wandb_project: str = "megamoe"
    """wandb project name."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0."""


@dataclass
class EvaluationConfig:
    """Held-out loss (megamoe.train.evaluate) on the valid split of `data.split`."""

    interval: int = 0
    """Evaluate every this many steps and at the end (metrics `heldout_loss` and each MoE layer's
    routing at inference, `heldout/layer{n}/...`; megamoe.train.evaluate); 0: never."""
    batches: int = 4
    """Global batches of the valid split evaluated each time (the same ones every time)."""


@dataclass
class GuardsConfig:
    """Divergence guards, checked every step before the optimizer update (megamoe.train.guards).

    A tripped guard never saves a checkpoint; a run it stops exits with code 3."""

    nonfinite: bool = True
    """Stop at a NaN or Inf loss or gradient norm, naming the step and the first module whose
    output (or parameter, or gradient) went non-finite (as Megatron-LM's
    --check-for-nan-in-loss-and-grad)."""
    spike_factor: float = 10.0
    """A loss above this many times the mean of the last `spike_window` steps is a spike (0:
    off). Checked once the window is full (after `spike_window` steps of this process)."""
    spike_window: int = 50
    """Steps in the loss spike guard's moving average."""
    spike_action: str = "rollback"
    """On a spike: `stop`, or `rollback`: reload the latest checkpoint, replay up to the spike
    and skip the spiking step's batch (PaLM, arXiv 2204.02311 sec. 5.1, skips the batches
    around a spike), at most `max_rollbacks` times."""
    max_rollbacks: int = 3
    """Rollbacks one process may do before a further spike stops the run; the dataset holds
    this many extra steps of samples for the skipped batches."""
    debug_nan_step: int = 0
    """Testing: just before step N set the first element of parameter `debug_nan_param` to NaN
    (0: never)."""
    debug_nan_param: str = "decoder.layers.1.mlp.experts"
    """Testing: the first parameter whose name (model.named_parameters()) starts with this."""
    debug_spike_step: int = 0
    """Testing: the micro-batches that step N reads in an uninterrupted run get label 0 (the
    unknown piece) everywhere, so their loss spikes (a rollback skips them; 0: never)."""


@dataclass
class FinetuneConfig:
    """Instruction tuning (megamoe.instruct.finetune) instead of pretraining."""

    method: str = "none"
    """`none` (pretraining on `data`), or a method of `megamoe.train.methods`; those of
    megamoe are instruction tuning: `full` (every weight of the model,
    dense or MoE, e.g. a sparse-upcycled one), `lora` (low-rank factors on every linear of a
    dense model) or `simoe` (sparse interpolated experts, arXiv 2506.12597). Start from a
    dense or upcycled checkpoint with `checkpoint.init_from`."""
    train_data: Optional[str] = None
    """jsonl of {prompt, response} or {messages} records (megamoe.instruct.dataset); None: the
    generated multi-domain set's seen task families (built once under `data.cache_dir`)."""
    eval_data: list[str] = field(default_factory=list)
    """jsonl files scored by exact match; empty: the generated set's held-out examples of the
    seen families and its unseen families."""
    eval_interval: int = 0
    """Exact match every this many steps (metrics `eval/{file}/{task}`); 0: at the end only."""
    max_new_tokens: int = 24
    """Longest generated answer at evaluation."""
    lora_rank: int = 8
    """`lora`: rank r of every low-rank update."""
    lora_alpha: float = 16.0
    """`lora`: the update is scaled by lora_alpha / lora_rank."""
    simoe: dict = field(default_factory=dict)
    """`simoe`: megamoe.simoe.SIMoEConfig fields (num_experts, target_sparsity, ...)."""


@dataclass
class TrainConfig:
    """A whole training run."""

    output_dir: str = "runs/default"
    """Metrics, TensorBoard, the resolved config and (by default) checkpoints go here."""
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: dict = field(default_factory=dict)
    """MoEConfig fields (see megamoe.config.MoEConfig; `num_experts` and `ffn_hidden_size` are
    required) and `layer_overrides: {layer index (0-based): {MoEConfig fields}}`. Metrics number
    layers from 1, as Megatron's layer_number: index 2 is `moe/layer3`."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    @property
    def checkpoint_dir(self) -> Path:
        """Where this run's checkpoints and `latest` marker live."""
        return Path(self.checkpoint.dir or Path(self.output_dir) / "checkpoints")

    def moe_config(self, layer: Optional[int] = None) -> MoEConfig:
        """The MoEConfig of MoE layers (with layer `layer`'s overrides, if given)."""
        fields = {k: v for k, v in self.moe.items() if k != "layer_overrides"}
        fields.update(self.moe.get("layer_overrides", {}).get(layer, {}))
        # What Megatron's TransformerConfig would give the layer (see megamoe.train.model).
        fields.setdefault("activation", "swiglu" if self.model.swiglu else "gelu")
        fields.setdefault("init_method_std", self.model.init_method_std)
        return MoEConfig(hidden_size=self.model.hidden_size, **fields)

    def to_dict(self) -> dict:
        """Plain nested data (what `dump_config` writes and checkpoints store)."""
        return dataclasses.asdict(self)


_SECTIONS = [f.name for f in dataclasses.fields(TrainConfig)]
KEY_ALIASES = {"data.tokenizer_model": "data.tokenizer"}
"""Keys older configs wrote -> the key that reads them now."""
_MOE_REQUIRED = ("num_experts", "ffn_hidden_size")


def _section_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {name: hints[name] for name in _SECTIONS}


def _moe_field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(MoEConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(MoEConfig) if f.name != "hidden_size"}


def known_keys() -> list[str]:
    """Every dotted key a config may set (MoE layer overrides excepted)."""
    keys = []
    for name, kind in _section_types().items():
        if dataclasses.is_dataclass(kind):
            keys += [f"{name}.{f.name}" for f in dataclasses.fields(kind)]
            keys += [f"model.yarn.{k}" for k in YARN_KEYS] if kind is ModelConfig else []
        elif name == "moe":
            keys += [f"moe.{k}" for k in _moe_field_types()] + ["moe.layer_overrides"]
        else:
            keys.append(name)
    return keys


def _shown(text: object, limit: int = 120) -> str:
    """`text` for a one-line message: control characters (a newline in an override) escaped,
    cut to `limit` characters."""
    text = str(text)
    text = text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
    return one_line(text)


def _unknown_key(key: str, where: str, candidates: list[str]) -> ConfigError:
    """An error naming `key` and the closest candidate (by whole key, else by its last part)."""
    key = str(key)  # a YAML key may be a number
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1,
                                                                cutoff=0.6)]
    hint = f"; did you mean '{close[0]}'?" if close else "; see megamoe/train/config.py"
    return ConfigError(f"unknown config key '{_shown(key)}' {where}{hint}")


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def _coerce(value: Any, kind: Any, key: str) -> Any:
    """`value` as type `kind` (int, float, bool, str, Optional, Union, list, tuple, dict), or
    raise."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
    elif origin is list and isinstance(value, (list, tuple)):
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    elif origin is dict or kind is dict:
        if isinstance(value, dict):
            return dict(value)
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:
                raise ConfigError(f"{key}={_brief(value)} is out of range (at most {MAX_INT:,} "
                                  "in magnitude)")
            return value
    elif kind is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) <= MAX_INT or isinstance(value, float) else None
        elif isinstance(value, str):  # YAML 1.1 reads `3e-4` as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}={_brief(value)} is not a finite number; give a "
                                  "finite value")
            return number
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}={_brief(value)} is not a valid {_type_name(kind)}")


def _brief(value: Any) -> str:
    """`repr(value)` cut to a few dozen characters, for a one-line message."""
    return _shown(_BRIEF.repr(value))


def coerce_fields(kind: Any, raw: dict, prefix: str) -> dict:
    """`raw`'s values as the types of dataclass `kind`'s fields of the same names (a value that
    is not is a ConfigError naming `prefix.key`)."""
    hints = typing.get_type_hints(kind)
    return {key: _coerce(value, hints[key], f"{prefix}.{key}") for key, value in raw.items()}


def _build_section(name: str, kind: Any, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"section '{name}' {where} must be a mapping, not {raw!r}")
    names = {f.name for f in dataclasses.fields(kind)}
    for key in raw:
        if key not in names:
            raise _unknown_key(f"{name}.{key}", where, known_keys())
    return kind(**coerce_fields(kind, raw, name))


def _moe_fields(raw: dict, prefix: str, where: str) -> dict:
    types = _moe_field_types()
    out = {}
    for key, value in raw.items():
        if key not in types:
            raise _unknown_key(f"{prefix}.{key}", where,
                               [f"{prefix}.{k}" for k in types] + known_keys())
        out[key] = _coerce(value, types[key], f"{prefix}.{key}")
    return out


def _build_moe(raw: Any, where: str) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"section 'moe' {where} must be a mapping, not {raw!r}")
    overrides = raw.get("layer_overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"moe.layer_overrides {where} must map layer indices to MoE settings")
    moe = _moe_fields({k: v for k, v in raw.items() if k != "layer_overrides"}, "moe", where)
    layers = {}
    for layer, fields in overrides.items():
        if not isinstance(layer, int) or not isinstance(fields, dict):
            raise ConfigError(f"moe.layer_overrides entry {layer!r} {where} must be "
                              "`<layer index>: {<MoEConfig field>: value}`")
        layers[layer] = _moe_fields(fields, f"moe.layer_overrides.{layer}", where)
    moe["layer_overrides"] = layers
    return moe


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
                raise ConfigError(f"{alias}={_brief(value)} and {key}={_brief(values[new])} "
                                  f"{where} disagree; {alias} is the older name of {key}: keep "
                                  "only one")
            raw = {**raw, section: {**values, new: value}}
    return raw


def config_from_dict(raw: Any, where: str = "in the config") -> TrainConfig:
    """Build and validate a TrainConfig from nested plain data (a parsed YAML document); the
    older key names of `KEY_ALIASES` are read as their new names."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the config {where} must be a mapping of sections, not {raw!r}")
    raw = _resolve_aliases(raw, where)
    values = {}
    for name, value in raw.items():
        if name not in _SECTIONS:
            raise _unknown_key(name, where, list(_SECTIONS) + known_keys())
        kind = _section_types()[name]
        if name == "moe":
            values[name] = _build_moe(value, where)
        elif dataclasses.is_dataclass(kind):
            values[name] = _build_section(name, kind, value if value is not None else {}, where)
        else:
            values[name] = _coerce(value, kind, name)
    config = TrainConfig(**values)
    validate(config)
    return config


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML)."""
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not key=value, e.g. training.train_steps=20")
    what = f"override '{_shown(text)}'"
    try:
        parsed = load_yaml(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    except ValueError as err:  # nesting or an integer beyond Python's limits
        raise ConfigError(f"{what} {err}") from None
    check_structure(parsed, ConfigError, what, MAX_CONFIG_VALUES)
    path = [int(p) if p.isdigit() and len(p) <= MAX_INT_DIGITS else p for p in key.split(".")]
    return path, parsed


def _check_override_path(path: list, text: str) -> None:
    """Reject an override of an unknown key before merging, so the message names the override."""
    where = f"in override '{_shown(text)}'"
    dotted = ".".join(map(str, path))
    if path[0] == "moe" and len(path) >= 2 and path[1] == "layer_overrides":
        if len(path) == 4 and path[3] not in _moe_field_types():
            raise _unknown_key(dotted, where, [f"moe.layer_overrides.{path[2]}.{k}"
                                               for k in _moe_field_types()])
        return
    if path[:2] == ["finetune", "simoe"] and len(path) == 3:
        return  # SIMoE's own fields: the simoe finetuning method checks their names
    if dotted not in known_keys():
        raise _unknown_key(dotted, where, known_keys())


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """A copy of `raw` with each `key=value` override set (dotted keys reach into sections)."""
    merged = yaml.safe_load(yaml.safe_dump(raw)) if raw else {}
    merged = _resolve_aliases(merged, "in the config")  # an override of either name wins
    for text in overrides:
        path, value = parse_override(text)
        alias = KEY_ALIASES.get(".".join(map(str, path)))
        path = alias.split(".") if alias else path
        _check_override_path(path, text)
        node = merged
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return merged


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """Read the YAML config at `path`, apply `overrides`, validate, return the TrainConfig."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {_shown(path)} does not exist; pass e.g. "
                          "configs/tiny_cpu.yaml")
    what = f"config file {_shown(path)}"
    raw = parse_yaml(read_bounded(path, MAX_CONFIG_BYTES, ConfigError, what), ConfigError,
                     what, MAX_CONFIG_VALUES) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {_shown(path)} must hold a mapping of sections")
    # Unknown keys in the file are reported against the file, those of overrides against them.
    config_from_dict(raw, f"in {path}")
    return config_from_dict(apply_overrides(raw, list(overrides)), "after the overrides")


def split_weights(split: str) -> list[float]:
    """`data.split` ("98,2,0", or with "/") as its train, valid and test weights (those left
    out are 0), normalised to sum 1. ConfigError unless it holds one to three non-negative
    decimals of finite, non-zero sum."""
    parts = re.split(r"[,/]", split)
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\d+(\.\d*)?", part.strip())
                                            for part in parts):
        raise ConfigError(f"data.split={_shown(repr(split))} must be one to three "
                          "comma-separated non-negative decimal train,valid,test weights, "
                          "e.g. 98,2,0")
    weights = [float(part) for part in parts] + [0.0] * (3 - len(parts))
    total = sum(weights)
    if not 0 < total < math.inf:
        raise ConfigError(f"data.split={_shown(repr(split))} must give the splits a finite, "
                          "non-zero total weight, e.g. 98,2,0")
    return [weight / total for weight in weights]


def check_blend_weights(weights: typing.Sequence[float], prefixes: int) -> None:
    """`data.weights`: one positive weight per data prefix, of finite sum (Megatron-Core
    normalises them by their sum)."""
    if len(weights) != prefixes or not all(0 < weight for weight in weights) \
            or not math.isfinite(sum(weights)):
        raise ConfigError(f"data.weights={list(weights)} must be {prefixes} positive weight(s) "
                          "of finite sum, one per data.prefixes entry, or null")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: TrainConfig) -> None:
    """Checks that span fields (each field's type is checked on load)."""
    m, t, o, d = config.model, config.training, config.optimizer, config.data
    for key, value in [("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
                       ("model.num_attention_heads", m.num_attention_heads),
                       ("model.ffn_hidden_size", m.ffn_hidden_size),
                       ("model.seq_length", m.seq_length),
                       ("training.train_steps", t.train_steps),
                       ("training.micro_batch_size", t.micro_batch_size),
                       ("training.global_batch_size", t.global_batch_size),
                       ("parallel.tensor", config.parallel.tensor),
                       ("parallel.pipeline", config.parallel.pipeline),
                       ("parallel.expert", config.parallel.expert),
                       ("parallel.virtual_stages", config.parallel.virtual_stages),
                       ("logging.interval", config.logging.interval)]:
        _require(value >= 1, f"{key}={value} must be >= 1")
    _require(m.hidden_size % m.num_attention_heads == 0,
             f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
             f"{m.num_attention_heads}; pick a divisor")
    _choice("model.normalization", m.normalization, NORMALIZATIONS)
    _choice("model.position_embedding", m.position_embedding, POSITION_EMBEDDINGS)
    _choice("training.precision", t.precision, PRECISIONS)
    _choice("training.device", t.device, DEVICES)
    _choice("training.recompute", t.recompute, RECOMPUTE)
    bad_modules = sorted(set(t.recompute_modules) - set(RECOMPUTE_MODULES))
    _require(not bad_modules, f"training.recompute_modules has {bad_modules}; choose from "
             f"{list(RECOMPUTE_MODULES)}")
    _require(m.multi_latent_attention or "mla_up_proj" not in t.recompute_modules,
             "training.recompute_modules has 'mla_up_proj', which needs "
             "model.multi_latent_attention=true; drop it")
    _require(config.parallel.virtual_stages == 1 or config.parallel.pipeline > 1,
             f"parallel.virtual_stages={config.parallel.virtual_stages} needs "
             "parallel.pipeline > 1")
    _choice("optimizer.decay_style", o.decay_style, DECAY_STYLES)
    _check_ranges(config)
    _check_latent_attention(config)
    _require(t.global_batch_size % t.micro_batch_size == 0,
             f"training.global_batch_size={t.global_batch_size} is not a multiple of "
             f"training.micro_batch_size={t.micro_batch_size}")
    _require(0 <= o.min_lr <= o.lr, f"optimizer.min_lr={o.min_lr} must be in [0, lr={o.lr}]")
    _require(o.warmup_steps >= 0, f"optimizer.warmup_steps={o.warmup_steps} must be >= 0")
    _require(o.decay_steps is None or o.decay_steps >= 1,
             f"optimizer.decay_steps={o.decay_steps} must be >= 1 or null")
    _require(t.grad_clip >= 0, f"training.grad_clip={t.grad_clip} must be >= 0 (0 disables)")
    _require(t.exit_interval >= 0, f"training.exit_interval={t.exit_interval} must be >= 0")
    _require(config.checkpoint.interval >= 0,
             f"checkpoint.interval={config.checkpoint.interval} must be >= 0 (0: at the end)")
    _require(config.checkpoint.keep_last >= 0,
             f"checkpoint.keep_last={config.checkpoint.keep_last} must be >= 0 (0: keep all)")
    _require(config.evaluation.interval >= 0,
             f"evaluation.interval={config.evaluation.interval} must be >= 0 (0: never)")
    _require(config.evaluation.batches >= 1,
             f"evaluation.batches={config.evaluation.batches} must be >= 1")
    _require(config.evaluation.interval == 0 or split_weights(d.split)[1] > 0,
             f"evaluation.interval={config.evaluation.interval} needs a valid split, but "
             f"data.split={d.split!r} holds out no documents; set e.g. data.split=95,5,0")
    _require(config.evaluation.interval == 0 or config.parallel.pipeline == 1,
             f"evaluation.interval={config.evaluation.interval} runs the model on one pipeline "
             f"stage; set parallel.pipeline=1 (got {config.parallel.pipeline}) or "
             "evaluation.interval=0")
    g = config.guards
    _require(g.spike_factor == 0 or g.spike_factor > 1,
             f"guards.spike_factor={g.spike_factor} must be > 1 (or 0 to switch the guard off)")
    _require(g.spike_window >= 1, f"guards.spike_window={g.spike_window} must be >= 1")
    _choice("guards.spike_action", g.spike_action, SPIKE_ACTIONS)
    for key, value in [("guards.max_rollbacks", g.max_rollbacks),
                       ("guards.debug_nan_step", g.debug_nan_step),
                       ("guards.debug_spike_step", g.debug_spike_step)]:
        _require(value >= 0, f"{key}={value} must be >= 0")
    _require(bool(d.tokenizer) or not d.prefixes,
             "data.prefixes needs data.tokenizer, the tokenizer the data was made with (a "
             "SentencePiece .model, a tokenizer.json or a Hugging Face folder)")
    _check_finetune(config)
    for key in _MOE_REQUIRED:
        _require(key in config.moe, f"moe.{key} is missing; every MoE model needs it")
    config.moe_config()  # MoEConfig validates the MoE settings
    for layer in config.moe["layer_overrides"]:
        _require(0 <= layer < m.num_layers,
                 f"moe.layer_overrides names layer {layer}, outside 0..{m.num_layers - 1}")
        config.moe_config(layer)
    for layer in range(m.num_layers):
        config.moe_config(layer).check_expert_parallel(config.parallel.expert)


def _check_finetune(config: TrainConfig) -> None:
    """`finetune.method` names an installed method (`megamoe.train.methods`), which checks the
    settings it trains with."""
    method = training_method(config.finetune.method)
    if method is not None:
        method.check(config)


def _check_ranges(config: TrainConfig) -> None:
    """Values Megatron-Core, PyTorch or the data loader would reject with a traceback later."""
    m, t, o, d, p = config.model, config.training, config.optimizer, config.data, config.parallel
    groups = m.num_query_groups
    _require(groups is None or (groups >= 1 and m.num_attention_heads % groups == 0),
             f"model.num_query_groups={groups} must divide model.num_attention_heads="
             f"{m.num_attention_heads} (or be null)")
    for key, value in [("model.num_attention_heads", m.num_attention_heads),
                       ("model.num_query_groups", groups)]:
        _require(value is None or value % p.tensor == 0,
                 f"{key}={value} is not divisible by parallel.tensor={p.tensor} (tensor ranks "
                 "split the attention heads); pick a tensor size that divides it")
    _require(m.seq_length % p.tensor == 0,
             f"model.seq_length={m.seq_length} is not divisible by parallel.tensor={p.tensor} "
             "(sequence parallelism splits each sequence over tensor ranks); pick a length the "
             "tensor size divides")
    _check_dense_layers(config)
    _require(m.init_method_std > 0, f"model.init_method_std={m.init_method_std} must be > 0")
    _require(m.norm_epsilon > 0, f"model.norm_epsilon={m.norm_epsilon} must be > 0")
    _require(m.kv_channels is None or m.kv_channels >= 1,
             f"model.kv_channels={m.kv_channels} must be >= 1 or null")
    _require(m.rope_scaling_factor is None or m.rope_scaling_factor >= 1,
             f"model.rope_scaling_factor={m.rope_scaling_factor} must be >= 1 or null")
    for key, value in [("model.hidden_dropout", m.hidden_dropout),
                       ("model.attention_dropout", m.attention_dropout),
                       ("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)]:
        _require(0 <= value < 1, f"{key}={value} must be in [0, 1)")
    _require(m.make_vocab_size_divisible_by >= 1,
             f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by} must be >= 1")
    _require(m.rotary_base > 0, f"model.rotary_base={m.rotary_base} must be > 0")
    for key, value in [("parallel.first_stage_layers", p.first_stage_layers),
                       ("parallel.last_stage_layers", p.last_stage_layers)]:
        _require(value is None or value >= 1, f"{key}={value} must be >= 1 or null")
    _check_uneven_stages(config)
    _require(o.eps > 0, f"optimizer.eps={o.eps} must be > 0")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    _require(t.seed >= 0, f"training.seed={t.seed} must be >= 0")
    _require(t.collective_timeout_s > 0,
             f"training.collective_timeout_s={t.collective_timeout_s} must be > 0")
    _require(d.num_workers >= 0, f"data.num_workers={d.num_workers} must be >= 0")
    _require(d.vocab_size >= 100, f"data.vocab_size={d.vocab_size} must be >= 100")
    _require(split_weights(d.split)[0] > 0,
             f"data.split={d.split!r} gives the train split no weight; e.g. data.split=98,2,0")
    if d.weights is not None:
        check_blend_weights(d.weights, len(d.prefixes))


def _check_dense_layers(config: TrainConfig) -> None:
    """`model.moe_layer_freq` and `model.first_k_dense` name a valid set of dense layers, and if
    there are any, tensor ranks split their MLP (`model.ffn_hidden_size`) evenly."""
    m, tensor = config.model, config.parallel.tensor
    try:
        is_moe = moe_layer_pattern(m, m.first_k_dense)
    except ConfigError as error:
        raise ConfigError(f"model.{error}") from None
    _require(all(is_moe) or m.ffn_hidden_size % tensor == 0,
             f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tensor="
             f"{tensor} (tensor ranks split the MLP of the dense layers); pick a tensor size "
             "that divides it")


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
    _require(middle_stages >= 0 and middle_layers >= 0 and
             (middle_stages == 0) == (middle_layers == 0) and
             (middle_stages == 0 or middle_layers % middle_stages == 0),
             f"{sizes} leave {middle_layers} of model.num_layers={layers} for "
             f"{max(middle_stages, 0)} middle stage(s) of parallel.pipeline={p.pipeline}; the "
             "middle stages must share the rest evenly (or set these null)")
    per_stage = [*given.values(), *([middle_layers // middle_stages] if middle_stages else [])]
    _require(all(n % p.virtual_stages == 0 for n in per_stage),
             f"{sizes} with parallel.virtual_stages={p.virtual_stages}: every stage's layers "
             f"({per_stage}) must split evenly over the virtual stages")


def _check_latent_attention(config: TrainConfig) -> None:
    """MLA's sizes, and the settings it replaces or cannot be combined with."""
    m, tensor = config.model, config.parallel.tensor
    for key, value in [("model.kv_lora_rank", m.kv_lora_rank),
                       ("model.qk_head_dim", m.qk_head_dim),
                       ("model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim),
                       ("model.v_head_dim", m.v_head_dim)]:
        _require(value >= 1, f"{key}={value} must be >= 1")
    _require(m.q_lora_rank is None or m.q_lora_rank >= 1,
             f"model.q_lora_rank={m.q_lora_rank} must be >= 1 or null")
    _require(m.qk_pos_emb_head_dim % 2 == 0, f"model.qk_pos_emb_head_dim={m.qk_pos_emb_head_dim} "
             "must be even (RoPE rotates pairs of channels)")
    if not m.multi_latent_attention:
        _require(not m.yarn, f"model.yarn={_brief(m.yarn)} is MLA's YaRN; set "
                 "model.multi_latent_attention=true, or model.rope_scaling_factor for Llama 3's")
        return
    _require(m.position_embedding == "rope", f"model.position_embedding="
             f"{m.position_embedding!r} cannot be combined with model.multi_latent_attention, "
             "which applies its own RoPE; set model.position_embedding=rope")
    _require(m.num_query_groups in (None, m.num_attention_heads),
             f"model.num_query_groups={m.num_query_groups} cannot be combined with "
             "model.multi_latent_attention (one key-value head per attention head); set it null")
    for key, value, fix in [
            ("model.rope_scaling_factor", m.rope_scaling_factor, "use model.yarn for MLA"),
            ("model.kv_channels", m.kv_channels, "set model.qk_head_dim and model.v_head_dim"),
            ("model.add_qkv_bias", m.add_qkv_bias or None, "MLA's projections have no bias")]:
        _require(value is None, f"{key}={value} cannot be combined with "
                 f"model.multi_latent_attention; {fix} and set {key} back to its default")
    down = [("model.kv_lora_rank + model.qk_pos_emb_head_dim",
             m.kv_lora_rank + m.qk_pos_emb_head_dim)]
    down += [("model.q_lora_rank", m.q_lora_rank)] if m.q_lora_rank is not None else []
    for key, value in down:
        _require(value % tensor == 0, f"{key}={value} is not divisible by parallel.tensor="
                 f"{tensor} (MLA's down projections are split over tensor ranks)")
    _check_yarn(m.yarn)


def _check_yarn(yarn: dict) -> None:
    """`model.yarn`: known keys, a factor, numbers in range."""
    for key in yarn:
        close = difflib.get_close_matches(str(key), list(YARN_KEYS), n=1)
        _require(key in YARN_KEYS, f"model.yarn has unknown key {_brief(key)}"
                 f"{f'; did you mean {close[0]!r}?' if close else ''} (keys: {list(YARN_KEYS)})")
    if not yarn:
        return
    _require("factor" in yarn, "model.yarn needs a factor (the context extension, e.g. 40)")
    for key, value in yarn.items():
        _require(isinstance(value, (int, float)) and not isinstance(value, bool)
                 and math.isfinite(value), f"model.yarn.{key}={_brief(value)} must be a number")
    settings = yarn_settings(yarn)
    _require(settings["factor"] >= 1, f"model.yarn.factor={settings['factor']} must be >= 1")
    for key in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
        _require(settings[key] > 0, f"model.yarn.{key}={settings[key]} must be > 0")
    for key in ("mscale", "mscale_all_dim"):
        _require(settings[key] >= 0, f"model.yarn.{key}={settings[key]} must be >= 0")


def yarn_settings(yarn: dict) -> dict:
    """`model.yarn` with the defaults of YARN_KEYS filled in."""
    return {**YARN_KEYS, **yarn}


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{key}={value!r} is not one of {list(choices)}")


def dump_config(config: TrainConfig) -> str:
    """The config as YAML text that `load_config` reads back to an equal config."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
