"""A Hugging Face MoE model's `config.json`, in megamoe's terms: the `model` and `moe` sections of
a megamoe training config that computes the same function.

`HFMoEModel` holds what every architecture's reader (one module per architecture,
megamoe.checkpointing.hf) finds: the attention/norm/RoPE settings shared with the dense
architectures (`megamoe.checkpointing.hf_arch`), the routed layers (`HFMoE`), DeepSeek's
multi-head latent attention (`HFMLA`), the multi-token-prediction layers the config announces,
and model/MoE settings of an architecture's own (`model_extra`, `moe_extra`). `Fields` reads
config.json fields typed and bounded, each failure one line naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megamoe.checkpointing.hf_arch import HFArch, positive_field, whole_field
from megamoe.errors import CheckpointError

MAX_EXPERTS = 1 << 14
"""More routed experts than this (16,384) is refused as a corrupt config."""
MIN_CORPUS_VOCAB = 100
"""The smallest `data.vocab_size` the default corpus's tokenizer takes (as megamoe.train.config
checks it)."""
DEEPSEEK_GROUP_SCORE_TOPK = 2
"""DeepSeek-V3 scores an expert group by the sum of its two best biased scores."""
DEEPSEEK_BIAS_UPDATE_RATE = 1e-3
"""DeepSeek-V3's bias update speed gamma (arXiv 2412.19437, sec. 4.2)."""
DEEPSEEK_SEQ_AUX_COEFF = 1e-4
"""DeepSeek-V3's sequence-wise balance loss factor alpha (arXiv 2412.19437, sec. 4.2)."""
DEFAULT_AUX = 1e-2
"""The Switch loss weight when config.json gives none (Switch Transformer's, arXiv 2101.03961)."""


@dataclass(frozen=True)
class HFMoE:
    """The routed layers of a Hugging Face MoE model, in megamoe's terms."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    pattern: tuple[bool, ...]
    """Per layer: MoE (True) or dense MLP."""
    score_function: str = "softmax"
    pre_softmax: bool = False
    shared_expert_ffn_size: Optional[int] = None
    shared_expert_gate: bool = False
    num_groups: Optional[int] = None
    groups_per_token: Optional[int] = None
    group_score_topk: Optional[int] = None
    topk_scaling_factor: Optional[float] = None
    expert_bias: bool = False
    """DeepSeek-V3's `e_score_correction_bias`, imported as megamoe's loss-free expert bias."""
    aux_loss_coeff: float = DEFAULT_AUX
    aux_from_config: bool = False
    """`aux_loss_coeff` is config.json's router_aux_loss_coef (else DEFAULT_AUX)."""
    global_batch_balance: bool = False
    """Qwen3-MoE balances its experts over the global batch (its report, arXiv 2505.09388,
    after Qiu et al., arXiv 2501.11873), not per micro-batch."""

    def moe_settings(self) -> dict[str, Any]:
        """The megamoe training config's `moe` section: the routing that reproduces the model,
        and its load balancing as the source model was trained with it (`balancing_notes`)."""
        balancing: dict[str, Any] = {
            "methods": "global_aux_loss" if self.global_batch_balance else "aux_loss",
            "aux_loss_coeff": self.aux_loss_coeff}
        if self.expert_bias:
            balancing.update(methods=["bias", "seq_aux_loss"],
                             bias_update_rate=DEEPSEEK_BIAS_UPDATE_RATE)
        return {"num_experts": self.num_experts, "ffn_hidden_size": self.ffn_hidden_size,
                "topk": self.topk,
                "router": {"kind": "topk", "score_function": self.score_function,
                           "pre_softmax": self.pre_softmax,
                           "topk_scaling_factor": self.topk_scaling_factor,
                           "num_groups": self.num_groups,
                           "groups_per_token": self.groups_per_token,
                           "group_score_topk": self.group_score_topk},
                "balancing": balancing,
                "shared_expert": {"ffn_hidden_size": self.shared_expert_ffn_size,
                                  "gate": self.shared_expert_gate}}

    def balancing_notes(self, model_type: str) -> dict[str, str]:
        """Why each balancing setting of `moe_settings` has its value (one line per dotted
        key)."""
        if self.expert_bias:
            return {"balancing.methods": "as DeepSeek-V3 trained (arXiv 2412.19437, sec. "
                                         "2.1.2): loss-free balancing by the expert bias (its "
                                         "e_score_correction_bias), plus a small sequence-wise "
                                         "loss",
                    "balancing.aux_loss_coeff": "DeepSeek-V3's sequence-wise balance factor "
                                                "alpha",
                    "balancing.bias_update_rate": "DeepSeek-V3's bias update speed gamma (it "
                                                  "set 0 for its last 500B tokens: set 0 to "
                                                  "freeze the routing)"}
        kind = ("the Switch loss over the global batch, as Qwen3 trained (arXiv 2505.09388)"
                if self.global_batch_balance else
                f"the Switch load-balancing loss (arXiv 2101.03961) {model_type} trains with")
        return {"balancing.methods": kind,
                "balancing.aux_loss_coeff": "config.json router_aux_loss_coef"
                if self.aux_from_config
                else f"config.json gives no router_aux_loss_coef: megamoe's {DEFAULT_AUX}"}


@dataclass(frozen=True)
class HFMLA:
    """DeepSeek's multi-head latent attention sizes (arXiv 2405.04434), Megatron's names."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    """Per head: the query/key part without RoPE (HF `qk_nope_head_dim`)."""
    qk_pos_emb_head_dim: int
    """Per head: the decoupled RoPE part (HF `qk_rope_head_dim`)."""
    v_head_dim: int
    rope_interleave: bool
    yarn: dict
    """megamoe's `model.yarn` (empty: plain RoPE)."""

    def model_settings(self) -> dict[str, Any]:
        return dict(multi_latent_attention=True, q_lora_rank=self.q_lora_rank,
                    kv_lora_rank=self.kv_lora_rank, qk_head_dim=self.qk_head_dim,
                    qk_pos_emb_head_dim=self.qk_pos_emb_head_dim, v_head_dim=self.v_head_dim,
                    yarn=dict(self.yarn))


@dataclass(frozen=True)
class HFMoEModel:
    arch: HFArch
    moe: HFMoE
    mla: Optional[HFMLA] = None
    mtp_layers: int = 0
    """The multi-token-prediction layers the config announces (`num_nextn_predict_layers`)."""
    model_extra: dict = field(default_factory=dict)
    """`model` settings of the architecture's own (e.g. partial rotary), added as they are."""
    moe_extra: dict = field(default_factory=dict)
    """`moe` settings of the architecture's own, merged section by section (e.g.
    `{"experts": {"bias": True}}`)."""

    @property
    def model_type(self) -> str:
        return self.arch.model_type

    def train_sections(self, with_mtp: bool = False) -> dict[str, dict]:
        """The `model` and `moe` sections of a megamoe training config for this model (with its
        multi-token-prediction layers when `with_mtp`), and a `data` section whose
        `vocab_size` (when the default corpus can have it) makes the default corpus's
        tokenizer as large as the model's vocabulary."""
        model = self.arch.model_settings()
        if self.mla is not None:
            for gqa_only in ("num_query_groups", "kv_channels", "qk_layernorm", "add_qkv_bias"):
                model.pop(gqa_only)
            model.update(self.mla.model_settings())
        pattern = self.moe.pattern
        model["moe_layer_freq"] = 1 if all(pattern) else [int(moe) for moe in pattern]
        if with_mtp and self.mtp_layers:
            model["mtp_layers"] = self.mtp_layers
        model.update(self.model_extra)
        moe = self.moe.moe_settings()
        for section, values in self.moe_extra.items():
            moe[section] = ({**moe.get(section, {}), **values} if isinstance(values, dict)
                            else values)
        sections = {"model": model, "moe": moe}
        if self.arch.vocab_size >= MIN_CORPUS_VOCAB:
            sections["data"] = {"vocab_size": self.arch.vocab_size}
        return sections


class Fields:
    """Typed, bounded reads of config.json fields, each failure one line naming the field."""

    def __init__(self, config: dict, where: Path):
        self.config, self.where = config, where

    def whole(self, name: str, limit: int = MAX_EXPERTS, default: Any = None) -> int:
        if self.config.get(name) is None:
            if default is None:
                raise CheckpointError(f"{self.where} lacks {name!r}; it is not a complete "
                                      f"{self.config.get('model_type')} config")
            return default
        return whole_field(self.config, name, self.where, limit)

    def positive(self, name: str, default: float) -> float:
        try:
            return positive_field(self.config.get(name, default), name, self.where)
        except (TypeError, ValueError):
            raise CheckpointError(f"{self.where}: {name}={self.config.get(name)!r:.40} must be "
                                  "a positive number") from None

    def flag(self, name: str, default: bool) -> bool:
        value = self.config.get(name, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.where}: {name}={value!r:.40} must be true or false")
        return value

    def refuse_if(self, condition: bool, name: str, why: str) -> None:
        if condition:
            raise CheckpointError(f"{self.where}: {name}={self.config.get(name)!r:.60} is not "
                                  f"supported ({why})")


def aux_coeff(fields: Fields) -> dict:
    """HFMoE's aux_loss_coeff/aux_from_config: config.json's router_aux_loss_coef, else (absent,
    null or 0) DEFAULT_AUX."""
    if not fields.config.get("router_aux_loss_coef"):
        return {"aux_loss_coeff": DEFAULT_AUX, "aux_from_config": False}
    return {"aux_loss_coeff": fields.positive("router_aux_loss_coef", DEFAULT_AUX),
            "aux_from_config": True}


def check_topk(fields: Fields, experts: int, topk: int) -> None:
    if topk > experts:
        raise CheckpointError(f"{fields.where}: num_experts_per_tok={topk} exceeds the "
                              f"{experts} routed experts; the config is corrupt")


def read_yarn(config: dict, fields: Fields) -> tuple[dict, dict]:
    """(config with plain RoPE, megamoe's `model.yarn`): DeepSeek's YaRN rope scaling (arXiv
    2309.00071; `rope_scaling` or transformers 5's `rope_parameters` with type yarn) as
    transformers computes it: the context factor (when null, max_position_embeddings over
    original_max_position_embeddings), beta_fast/slow, and cos/sin scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else by
    mscale(factor, 1), the softmax by mscale(factor, mscale_all_dim)^2 when set, and GPT-OSS's
    untruncated correction range (`truncate: false`, kept as `model.yarn.truncate`). An explicit
    `attention_factor` is refused."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    if not isinstance(scaling, dict) or \
            scaling.get("rope_type", scaling.get("type", "default")) != "yarn":
        return config, {}
    where = fields.where
    if scaling.get("attention_factor") is not None:
        raise CheckpointError(f"{where}: rope scaling attention_factor="
                              f"{scaling['attention_factor']!r:.40} is not supported (megamoe's "
                              "YaRN derives it from the factor and mscales)")
    scaled = Fields(scaling, where)
    original = scaled.whole("original_max_position_embeddings", limit=1 << 24)
    factor = scaling.get("factor")
    factor = (fields.whole("max_position_embeddings", limit=1 << 24) / original
              if factor is None else scaled.positive("factor", 1.0))
    if factor < 1:
        raise CheckpointError(f"{where}: yarn rope scaling factor={factor:.4g} shortens the "
                              "context; megamoe's YaRN takes factors >= 1")
    yarn = {"factor": factor, "original_max_position_embeddings": original,
            "beta_fast": scaled.positive("beta_fast", 32.0),
            "beta_slow": scaled.positive("beta_slow", 1.0)}
    if not scaled.flag("truncate", True):
        yarn["truncate"] = False
    all_dim = scaling.get("mscale_all_dim") or 0.0
    if all_dim:
        yarn.update(mscale=scaled.positive("mscale", 1.0),
                    mscale_all_dim=scaled.positive("mscale_all_dim", 1.0))
    theta = {"rope_theta": params.get("rope_theta", config.get("rope_theta", 10000.0))}
    return {**config, "rope_scaling": None, "rope_parameters": theta}, yarn
