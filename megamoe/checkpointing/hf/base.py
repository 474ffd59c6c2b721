"""The two-way table of a Hugging Face architecture: its config mapping and its tensor-name
mapping, stated once and read by both the import (megamoe.checkpointing.hf_moe_source) and the
export (megamoe.interop.hf_export).

An architecture is one `Architecture` subclass (one module of this package, one line in its
registry, `megamoe.checkpointing.hf`):
- `read_config(config, where)`: config.json -> `HFMoEModel` (megamoe's `model`/`moe` sections
  through `HFMoEModel.train_sections()`), refusing in one line what megamoe cannot reproduce;
- `write_config(settings)`: the trained settings (`ExportSettings`) -> config.json;
- `check_expressible(settings)`: refuse (`self.refuse`) a setting the architecture cannot hold;
- `layer_rules(model, index)`: the tensors of decoder layer `index`, each a `Rule` pairing
  Hugging Face names (relative to `model.layers.{index}.`) with one Megatron key (relative to
  the layer) and a `Transform` with its inverse.
The export writes config.json first and builds its rules from that very file read back
(`read_config`), so what it writes is exactly what the import expects.

The idea follows torchtitan's state-dict adapters (`from_hf_map`: Hugging Face names with the
layer index left open, paired with the model's names); here a rule also carries the shapes
config.json implies and the transform between the two layouts, so one table drives the shape
check, the import and the export. Every conversion counts the tensors it read and wrote
(`TensorLedger`) and fails naming the first tensor left over or missing.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from megamoe.checkpointing.hf_arch import LLAMA3_ROPE, HFArch
from megamoe.checkpointing.hf_moe_arch import HFMoEModel
from megamoe.checkpointing.hf_source import interleave_qkv, split_qkv
from megamoe.checkpointing.sharded_keys import EXPERTS
from megamoe.errors import CheckpointError, ConfigError

Shape = tuple[int, ...]
MEGATRON_EXPERTS = EXPERTS
"""Where a layer's routed experts live in Megatron (`mlp.experts.experts.`)."""


# -- transforms: a Megatron tensor from its Hugging Face tensors, and back ---------------------

class Transform:
    """One Megatron tensor from a rule's Hugging Face tensors (`to_megatron`) and the exact
    inverse (`to_hf`), so a round trip is bit-identical."""

    def to_megatron(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def to_hf(self, tensor: torch.Tensor, shapes: Sequence[Shape]) -> list[torch.Tensor]:
        """The Hugging Face tensors, of `shapes` (the rule's), from the Megatron one."""
        raise NotImplementedError


class Identity(Transform):
    """The same tensor on both sides."""

    def to_megatron(self, parts):
        return parts[0]

    def to_hf(self, tensor, shapes):
        return [tensor]


class Concat(Transform):
    """Rows stacked in order: Megatron's SwiGLU fc1 [gate; up] from HF's gate and up
    projections; the inverse splits at the rule's row counts."""

    def to_megatron(self, parts):
        return torch.cat(list(parts))

    def to_hf(self, tensor, shapes):
        return [part.contiguous() for part in tensor.split([s[0] for s in shapes])]


@dataclass(frozen=True)
class GroupedQKV(Transform):
    """Megatron's fused QKV rows, per key/value group [its Q heads, its K, its V]
    (megamoe.checkpointing.hf_source.interleave_qkv / split_qkv), from HF's q, k, v
    projections (weights or biases)."""

    arch: HFArch

    def to_megatron(self, parts):
        return interleave_qkv(*parts, self.arch.num_key_value_heads)

    def to_hf(self, tensor, shapes):
        return list(split_qkv(tensor, self.arch))


@dataclass(frozen=True)
class Reshape(Transform):
    """The same elements in Megatron's `shape` (e.g. Qwen2-MoE's shared-expert gate [1, H] as
    Megatron's [H])."""

    shape: Shape

    def to_megatron(self, parts):
        return parts[0].reshape(self.shape)

    def to_hf(self, tensor, shapes):
        return [tensor.reshape(shapes[0])]


IDENTITY = Identity()
CONCAT = Concat()


# -- rules ---------------------------------------------------------------------------------

ALL_EXPERTS = -1
"""`Rule.expert` for a Megatron tensor stacked over every routed expert [E, ...] (one Hugging
Face tensor holding all experts, e.g. GPT-OSS's `mlp.experts.gate_up_proj`)."""


@dataclass(frozen=True)
class Rule:
    """Hugging Face tensors `hf` (of `shapes`, the ones config.json implies) <-> one Megatron
    tensor `megatron`, through `transform`. Names are relative to their block (a decoder layer:
    `model.layers.{i}.` / `decoder.layers.{i}.`)."""

    megatron: str
    """Megatron key, e.g. `self_attention.linear_qkv.weight`; a routed expert's is
    `mlp.experts.experts.linear_fc1.weight` with `expert` set."""
    hf: tuple[str, ...]
    shapes: tuple[Shape, ...]
    transform: Transform = IDENTITY
    expert: Optional[int] = None
    """The routed expert this Megatron tensor belongs to; ALL_EXPERTS: stacked over all."""
    dtype: Optional[torch.dtype] = None
    """Kept in this dtype (DeepSeek's fp32 correction bias); None: the model's dtype."""
    aliases: tuple[str, ...] = ()
    """Other Megatron keys the export takes for the same tensor (the pre-MLP norm is
    `mlp.linear_fc1.layer_norm_weight` or `pre_mlp_layernorm.weight` by spec)."""
    zeros_if_absent: bool = False
    """Export: a checkpoint without this Megatron tensor writes zeros (Qwen2-MoE always has
    QKV biases, DeepSeek-V3 always a correction bias)."""
    nonzero_refusal: Optional[str] = None
    """A Megatron tensor with no Hugging Face place (`hf` empty): the export accepts it only
    when all zero, else refuses with this text (`{layer}` and `{max}` filled in)."""
    copy_of: Optional[str] = None
    """This HF tensor is a copy of the (absolute) HF tensor `copy_of`, e.g. DeepSeek's MTP
    `embed_tokens`: the import checks they are equal and writes nothing; the export writes the
    (absolute) Megatron key `megatron` again."""

    @property
    def glu(self) -> bool:
        """A SwiGLU fc1 weight or bias: Megatron stores its gate and up halves as two chunks."""
        return self.megatron.rsplit(".", 1)[0].endswith("linear_fc1") and \
            self.megatron.rsplit(".", 1)[1] in ("weight", "bias")


def same(hf: str, megatron: str, shape: Shape, **kw: Any) -> Rule:
    """One HF tensor stored unchanged under `megatron`."""
    return Rule(megatron, (hf,), (shape,), IDENTITY, **kw)


def glu(gate: str, up: str, megatron: str, gate_shape: Shape, **kw: Any) -> Rule:
    """Megatron's SwiGLU fc1 [gate; up] from two HF projections of `gate_shape` each."""
    return Rule(megatron, (gate, up), (gate_shape, gate_shape), CONCAT, **kw)


def swiglu_mlp(hf_prefix: str, megatron_prefix: str, names: tuple[str, str, str], ffn: int,
               hidden: int, **kw: Any) -> list[Rule]:
    """A SwiGLU MLP: HF `{hf_prefix}{gate,up,down}.weight` (`names`) <-> Megatron
    `{megatron_prefix}linear_fc1.weight` ([gate; up]) and `linear_fc2.weight`."""
    gate, up, down = (f"{hf_prefix}{name}.weight" for name in names)
    return [glu(gate, up, megatron_prefix + "linear_fc1.weight", (ffn, hidden), **kw),
            same(down, megatron_prefix + "linear_fc2.weight", (hidden, ffn), **kw)]


def routed_experts(hf_prefix: str, names: tuple[str, str, str], num_experts: int, ffn: int,
                   hidden: int) -> list[Rule]:
    """Per-expert HF tensors `{hf_prefix}{e}.{gate,up,down}.weight` <-> Megatron's routed
    experts (`mlp.experts.experts.linear_fc1/fc2.weight` of expert e)."""
    return [rule for e in range(num_experts)
            for rule in swiglu_mlp(f"{hf_prefix}{e}.", MEGATRON_EXPERTS, names, ffn, hidden,
                                   expert=e)]


def prefixed(rules: Iterable[Rule], hf: str = "", megatron: str = "") -> list[Rule]:
    """`rules` with `hf` / `megatron` put before their names (e.g. a decoder layer's rules as
    the transformer layer of an MTP block: megatron="transformer_layer.")."""
    return [replace(rule, hf=tuple(hf + name for name in rule.hf),
                    megatron=rule.megatron if rule.copy_of else megatron + rule.megatron,
                    aliases=tuple(megatron + alias for alias in rule.aliases))
            for rule in rules]


@dataclass(frozen=True)
class Block:
    """A group of rules converted together and the prefixes of their names: the tensors
    outside the layers (`hf_prefix` and `megatron_prefix` empty), decoder layer `layer`
    (`model.layers.{i}.`, placed by Megatron's key layout), or an MTP layer
    (`model.layers.{N+k}.` <-> `mtp.layers.{k}.`)."""

    hf_prefix: str
    megatron_prefix: str
    rules: tuple[Rule, ...]
    layer: Optional[int] = None
    """The decoder layer (its Megatron keys follow the checkpoint's stacked/per-layer
    layout); None: keys `megatron_prefix + rule.megatron`, experts on an axis of their own."""
    is_moe: bool = False
    """Its MLP is routed (for the conversion's per-part metrics)."""

    def hf_names(self) -> dict[str, Shape]:
        """Absolute HF name -> shape of every tensor this block reads or writes."""
        return {self.hf_prefix + name: shape for rule in self.rules
                for name, shape in zip(rule.hf, rule.shapes)}


# -- the export's settings ------------------------------------------------------------------

@dataclass(frozen=True)
class ExportSettings:
    """What the export knows of the trained model, for `write_config` and
    `check_expressible`."""

    model: Any
    """The training config's `model` section (megamoe.train.settings.model.ModelConfig)."""
    moe: Any
    """The MoE settings (megamoe.config.MoEConfig)."""
    pattern: tuple[bool, ...]
    """Per decoder layer: MoE (True) or dense MLP."""
    vocab_size: int = 0
    context: int = 0
    """The context the model was trained for (config.json's max_position_embeddings)."""
    mtp_layers: int = 0
    yarn: dict = field(default_factory=dict)
    """`model.yarn`'s numbers with their defaults filled in (megamoe.train.settings.model
    `yarn_settings`; empty: plain RoPE); its `truncate` flag stays in `model.yarn`."""
    aux_loss_coeff: float = 0.0
    """The weight of the balance loss the model trained with (config.json's
    router_aux_loss_coef)."""


FEATURES: dict[str, tuple[Callable[[ExportSettings], bool], str]] = {
    "mtp": (lambda s: s.model.mtp_layers > 0, "multi-token prediction (model.mtp_layers)"),
    "partial_rotary": (lambda s: s.model.rotary_percent != 1.0,
                       "a partial rotary embedding (model.rotary_percent)"),
    "projection_qk_norm": (lambda s: s.model.qk_layernorm_scope == "projection",
                           "a QK norm over the whole projection (model.qk_layernorm_scope)"),
    "expert_bias": (lambda s: s.moe.experts.bias, "expert biases (moe.experts.bias)"),
    "router_bias": (lambda s: s.moe.router.bias, "a router bias (moe.router.bias)"),
    "attention_sinks": (lambda s: s.model.attention_sinks,
                        "attention sinks (model.attention_sinks)"),
    "sliding_window": (lambda s: s.model.sliding_window is not None,
                       "sliding-window attention (model.sliding_window)"),
    "linear_bias": (lambda s: s.model.add_bias_linear,
                    "biases on the linear layers (model.add_bias_linear)"),
    "yarn": (lambda s: bool(s.model.yarn), "YaRN rope scaling (model.yarn)"),
}
"""Model features only some architectures hold: name -> (does the model use it, what it is).
An architecture lists those it holds in `Architecture.features`."""


# -- the architecture interface -------------------------------------------------------------

NON_LAYER = (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
             ("model.norm.weight", "decoder.final_layernorm.weight"),
             ("lm_head.weight", "output_layer.weight"))


class Architecture:
    """One Hugging Face architecture's two-way table (module docstring). Subclasses set the
    class attributes and implement the four hooks; the rest is shared."""

    model_type: str = ""
    """config.json's `model_type`, the export's `--arch`."""
    hf_class: str = ""
    """config.json's `architectures[0]` (transformers' class)."""
    activations: tuple[str, ...] = ("swiglu",)
    """The `moe.experts.activation` values the architecture's experts compute."""
    features: frozenset[str] = frozenset()
    """The FEATURES it can hold; the export refuses a model using any other."""

    # hooks ------------------------------------------------------------------------------
    def read_config(self, config: dict, where: Path) -> HFMoEModel:
        """config.json -> the model in megamoe's terms; one-line CheckpointError naming the
        field for what megamoe cannot reproduce."""
        raise NotImplementedError

    def write_config(self, settings: ExportSettings) -> dict:
        """The trained settings -> config.json (without token ids and dtype: the export adds
        them). Reading it back (`read_config`) must give the same model."""
        raise NotImplementedError

    def check_expressible(self, settings: ExportSettings) -> None:
        """Refuse (`self.refuse`) the first setting this architecture cannot express."""
        raise NotImplementedError

    def layer_rules(self, model: HFMoEModel, index: int) -> list[Rule]:
        """The rules of decoder layer `index`, names relative to the layer."""
        raise NotImplementedError

    # shared -----------------------------------------------------------------------------
    def refuse(self, what: str, fix: str) -> None:
        raise ConfigError(f"--arch {self.model_type} cannot express {what}; {fix}")

    def non_layer_rules(self, model: HFMoEModel) -> list[Rule]:
        """The embedding, final norm and (untied) output layer."""
        a = model.arch
        shapes = {"model.norm.weight": (a.hidden_size,)}
        return [same(hf, mg, shapes.get(hf, (a.vocab_size, a.hidden_size)))
                for hf, mg in NON_LAYER
                if not (hf == "lm_head.weight" and a.tie_word_embeddings)]

    def blocks(self, model: HFMoEModel) -> list[Block]:
        """The tensors outside the layers, then each decoder layer (the multi-token-prediction
        layers' blocks come from `megamoe.checkpointing.hf.mtp.mtp_blocks`)."""
        blocks = [Block("", "", tuple(self.non_layer_rules(model)))]
        return blocks + [Block(f"model.layers.{i}.", "", tuple(self.layer_rules(model, i)),
                               layer=i, is_moe=model.moe.pattern[i])
                         for i in range(model.arch.num_layers)]


ARCHITECTURES: dict[str, Architecture] = {}
"""model_type -> its table, in registration order (the export's preference for a default
`--arch`): filled by `register` as `megamoe.checkpointing.hf` imports each module."""


def register(cls: type[Architecture]) -> type[Architecture]:
    """Class decorator: add the architecture to ARCHITECTURES."""
    ARCHITECTURES[cls.model_type] = cls()
    return cls


# -- building blocks shared by the architectures ----------------------------------------------

def gqa_attention_rules(a: HFArch) -> list[Rule]:
    """A Llama-family layer's grouped-query attention and its two norms: HF `input_layernorm`,
    `self_attn.{q,k,v}_proj` (weights, and biases with `a.qkv_bias`), `o_proj`, `{q,k}_norm`
    (per head, with `a.qk_norm`), `post_attention_layernorm` <-> Megatron's fused
    `self_attention.linear_qkv` (GroupedQKV), `linear_proj`, `{q,k}_layernorm` and the pre-MLP
    norm `mlp.linear_fc1.layer_norm_weight`."""
    H, d = a.hidden_size, a.head_dim
    q, kv = a.num_attention_heads * d, a.num_key_value_heads * d
    qkv = tuple(f"self_attn.{n}_proj" for n in "qkv")
    rules = [same("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", (H,),
                  aliases=("input_layernorm.weight",)),
             Rule("self_attention.linear_qkv.weight", tuple(n + ".weight" for n in qkv),
                  ((q, H), (kv, H), (kv, H)), GroupedQKV(a)),
             same("self_attn.o_proj.weight", "self_attention.linear_proj.weight", (H, q)),
             same("post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", (H,),
                  aliases=("pre_mlp_layernorm.weight",))]
    if a.qkv_bias:
        rules.append(Rule("self_attention.linear_qkv.bias", tuple(n + ".bias" for n in qkv),
                          ((q,), (kv,), (kv,)), GroupedQKV(a)))
    if a.qk_norm:
        rules += [same(f"self_attn.{n}_norm.weight", f"self_attention.{n}_layernorm.weight",
                       (d,)) for n in "qk"]
    return rules


MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def dense_mlp_rules(a: HFArch) -> list[Rule]:
    """A dense layer's SwiGLU MLP: HF `mlp.{gate,up,down}_proj` <-> Megatron `mlp.linear_fc1`
    ([gate; up]) and `mlp.linear_fc2`."""
    return swiglu_mlp("mlp.", "mlp.", MLP_NAMES, a.intermediate_size, a.hidden_size)


def common_config(arch: Architecture, s: ExportSettings) -> dict:
    """The config.json fields every Llama-family MoE architecture shares, from the trained
    settings (Megatron-Core's Llama 3 rope scaling with its fixed constants)."""
    m = s.model
    out = dict(
        architectures=[arch.hf_class], model_type=arch.model_type, vocab_size=s.vocab_size,
        hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads, hidden_act="silu",
        max_position_embeddings=s.context, rms_norm_eps=m.norm_epsilon,
        rope_theta=float(m.rotary_base), tie_word_embeddings=m.share_embeddings,
        num_experts_per_tok=s.moe.topk, attention_dropout=0.0, use_cache=True)
    if m.rope_scaling_factor is not None:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": m.rope_scaling_factor,
                               **LLAMA3_ROPE}
    return out


# -- counting what a conversion read and wrote ----------------------------------------------

class TensorLedger:
    """The tensors a conversion must account for (`expected`: name -> shape), and those it
    has read or written; `close` fails in one line naming the first one left over."""

    def __init__(self, expected: dict[str, Shape], where: str, what: str):
        self.expected, self.where, self.what = dict(expected), where, what
        self.done: set[str] = set()
        self.skipped: set[str] = set()

    def mark(self, name: str, shape: Optional[Shape] = None) -> None:
        """`name` was read (import) or written (export), with `shape` when known."""
        if name not in self.expected:
            raise CheckpointError(f"{self.where}: tensor {name} is not among the "
                                  f"{len(self.expected)} tensors of {self.what}; the table "
                                  "and the checkpoint disagree")
        if shape is not None and tuple(shape) != tuple(self.expected[name]):
            raise CheckpointError(f"{self.where}: tensor {name} has shape {list(shape)} but "
                                  f"{self.what} implies {list(self.expected[name])}")
        self.done.add(name)

    def skip(self, names: Iterable[str]) -> None:
        """Tensors left out on purpose (e.g. `--drop-mtp`); counted, named in `summary`."""
        self.skipped.update(names)

    def close(self) -> str:
        """Fail naming the first expected tensor neither done nor skipped; else a one-line
        count."""
        left = sorted(set(self.expected) - self.done - self.skipped)
        if left:
            raise CheckpointError(f"{self.where}: tensor {left[0]} of {self.what} was not "
                                  f"converted ({len(left)} left over of "
                                  f"{len(self.expected)}); the conversion is incomplete")
        return self.summary()

    def summary(self) -> str:
        text = f"{len(self.done)} of {len(self.expected)} tensors of {self.what}"
        return text + (f" ({len(self.skipped)} dropped)" if self.skipped else "")
