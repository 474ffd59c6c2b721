"""A released Hugging Face MoE model's `config.json` (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3)
as the `model` and `moe` sections of a megamoe training config that computes the same function.

`read_hf_moe_model(dir)` returns an `HFMoEModel`: the attention/norm/RoPE settings shared with
the dense architectures (`megamoe.checkpointing.hf_arch`), the routed layers (`HFMoE`) and, for
DeepSeek-V3, multi-head latent attention (`HFMLA`). What the source expresses that megamoe cannot
is refused in one line naming the field:

- Mixtral (Jiang et al., arXiv 2401.04088): softmax top-k, gates renormalised over the chosen
  experts, every layer MoE; a sliding window is refused.
- Qwen2-MoE / Qwen3-MoE: softmax top-k, renormalised when `norm_topk_prob` (else the softmax over
  all experts, megamoe's `router.pre_softmax`); MoE layers where `(i + 1) %
  decoder_sparse_step == 0` and `i` not in `mlp_only_layers`, dense ones elsewhere; Qwen2-MoE's
  sigmoid-gated shared expert and QKV biases; Qwen3-MoE's per-head QK norm.
- DeepSeek-V3 (arXiv 2412.19437): sigmoid scores, selection by scores plus
  `e_score_correction_bias` (megamoe's loss-free expert bias, arXiv 2408.15664, which keeps
  training from the imported values) within the `topk_group` best of `n_group` groups, each
  scored by its top-2 biased scores (megamoe's `router.group_score_topk`), gates renormalised
  (`norm_topk_prob`) and scaled by `routed_scaling_factor`; `n_shared_experts` ungated shared
  experts; the first `first_k_dense_replace` layers dense; MLA with low-rank q (`q_lora_rank`,
  or a full q projection when null) and kv (`kv_lora_rank`) projections, RMSNorm on both
  latents, and decoupled RoPE (`qk_rope_head_dim`) on DeepSeek's interleaved pairs
  (`rope_interleave`; a source without it is permuted into that convention).
  Multi-token-prediction layers (`num_nextn_predict_layers`) are megamoe-incompatible; their
  weights, when the files hold them, are refused unless dropped explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megamoe.checkpointing.hf_arch import (CONFIG_FILE, DENSE_TYPES, HFArch, parse_hf_arch,
                                           positive_field, read_config_json, whole_field)
from megamoe.errors import CheckpointError

MOE_IMPORT_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
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
    """DeepSeek-V3's multi-token-prediction layers announced by the config."""

    @property
    def model_type(self) -> str:
        return self.arch.model_type

    def train_sections(self) -> dict[str, dict]:
        """The `model` and `moe` sections of a megamoe training config for this model, and a
        `data` section whose `vocab_size` (when the default corpus can have it) makes the
        default corpus's tokenizer as large as the model's vocabulary."""
        model = self.arch.model_settings()
        if self.mla is not None:
            for gqa_only in ("num_query_groups", "kv_channels", "qk_layernorm", "add_qkv_bias"):
                model.pop(gqa_only)
            model.update(self.mla.model_settings())
        pattern = self.moe.pattern
        model["moe_layer_freq"] = 1 if all(pattern) else [int(moe) for moe in pattern]
        sections = {"model": model, "moe": self.moe.moe_settings()}
        if self.arch.vocab_size >= MIN_CORPUS_VOCAB:
            sections["data"] = {"vocab_size": self.arch.vocab_size}
        return sections


def read_hf_moe_model(directory: Path) -> HFMoEModel:
    """The MoE model in `directory`, checked to be one megamoe reproduces (module docstring)."""
    config = read_config_json(directory)
    where = directory / CONFIG_FILE
    kind = config.get("model_type")
    if kind in DENSE_TYPES:
        raise CheckpointError(f"{where}: model_type {kind!r} is dense; read it with "
                              "megamoe.checkpointing.hf_arch.read_hf_arch")
    if kind not in MOE_IMPORT_TYPES:
        raise CheckpointError(f"{where}: model_type={kind!r} cannot be imported; supported MoE "
                              f"architectures: {', '.join(MOE_IMPORT_TYPES)}")
    fields = _Fields(config, where)
    if kind == "mixtral":
        return _mixtral(config, fields, where)
    if kind in ("qwen2_moe", "qwen3_moe"):
        return _qwen_moe(config, fields, where, kind)
    return _deepseek_v3(config, fields, where)


class _Fields:
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


def _aux_coeff(fields: _Fields) -> dict:
    """HFMoE's aux_loss_coeff/aux_from_config: config.json's router_aux_loss_coef, else (absent,
    null or 0) DEFAULT_AUX."""
    if not fields.config.get("router_aux_loss_coef"):
        return {"aux_loss_coeff": DEFAULT_AUX, "aux_from_config": False}
    return {"aux_loss_coeff": fields.positive("router_aux_loss_coef", DEFAULT_AUX),
            "aux_from_config": True}


def _check_topk(fields: _Fields, experts: int, topk: int) -> None:
    if topk > experts:
        raise CheckpointError(f"{fields.where}: num_experts_per_tok={topk} exceeds the "
                              f"{experts} routed experts; the config is corrupt")


def _mixtral(config: dict, fields: _Fields, where: Path) -> HFMoEModel:
    fields.refuse_if(config.get("sliding_window") is not None, "sliding_window",
                     "megamoe trains full causal attention; set it to null if the model's "
                     "context never exceeds it")
    arch = parse_hf_arch(config, where, qkv_bias=False, qk_norm=False)
    experts, topk = fields.whole("num_local_experts"), fields.whole("num_experts_per_tok")
    _check_topk(fields, experts, topk)
    moe = HFMoE(num_experts=experts, topk=topk, ffn_hidden_size=arch.intermediate_size,
                pattern=(True,) * arch.num_layers, **_aux_coeff(fields))
    return HFMoEModel(arch, moe)


def _qwen_moe(config: dict, fields: _Fields, where: Path, kind: str) -> HFMoEModel:
    qwen2 = kind == "qwen2_moe"
    if not qwen2:
        fields.refuse_if(bool(config.get("attention_bias")), "attention_bias",
                         "megamoe's attention output projection has no bias")
    arch = parse_hf_arch(config, where, qkv_bias=qwen2 and fields.flag("qkv_bias", True),
                         qk_norm=not qwen2)
    # transformers 5 saves Qwen3-MoE's `num_experts` under its attribute-map name.
    experts = fields.whole("num_experts" if config.get("num_experts") is not None
                           else "num_local_experts")
    topk = fields.whole("num_experts_per_tok")
    _check_topk(fields, experts, topk)
    step = fields.whole("decoder_sparse_step", default=1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) or isinstance(i, bool)
                                          for i in dense):
        raise CheckpointError(f"{where}: mlp_only_layers={dense!r:.60} must be a list of layer "
                              "indices")
    pattern = tuple(i not in dense and (i + 1) % step == 0 for i in range(arch.num_layers))
    if not any(pattern):
        raise CheckpointError(f"{where}: decoder_sparse_step={step} / mlp_only_layers leave no "
                              "MoE layer; import it as a dense model")
    shared = fields.whole("shared_expert_intermediate_size", limit=1 << 20) if qwen2 else None
    moe = HFMoE(num_experts=experts, topk=topk,
                ffn_hidden_size=fields.whole("moe_intermediate_size", limit=1 << 20),
                pattern=pattern, pre_softmax=not fields.flag("norm_topk_prob", False),
                shared_expert_ffn_size=shared, shared_expert_gate=qwen2,
                global_batch_balance=not qwen2, **_aux_coeff(fields))
    return HFMoEModel(arch, moe)


def _deepseek_v3(config: dict, fields: _Fields, where: Path) -> HFMoEModel:
    fields.refuse_if(bool(config.get("attention_bias")), "attention_bias",
                     "megamoe's MLA projections have no biases")
    # `head_dim` of a DeepSeek config is the RoPE width, not an attention head size.
    plain_rope, yarn = _yarn(config, fields)
    arch = parse_hf_arch({**plain_rope, "head_dim": None}, where, qkv_bias=False, qk_norm=False)
    if arch.num_key_value_heads != arch.num_attention_heads:
        raise CheckpointError(f"{where}: num_key_value_heads={arch.num_key_value_heads} must "
                              f"equal num_attention_heads={arch.num_attention_heads} for MLA")
    experts, topk = fields.whole("n_routed_experts"), fields.whole("num_experts_per_tok")
    _check_topk(fields, experts, topk)
    groups, per_token = fields.whole("n_group", default=1), fields.whole("topk_group", default=1)
    if experts % groups or per_token > groups:
        raise CheckpointError(f"{where}: n_group={groups} / topk_group={per_token} do not split "
                              f"{experts} experts; the config is inconsistent")
    if groups > 1 and (experts // groups < DEEPSEEK_GROUP_SCORE_TOPK
                       or topk > per_token * experts // groups):
        raise CheckpointError(f"{where}: n_group={groups} / topk_group={per_token} leave groups "
                              f"of fewer than {DEEPSEEK_GROUP_SCORE_TOPK} experts or fewer than "
                              f"num_experts_per_tok={topk} experts to choose from; the config "
                              "is inconsistent")
    fields.refuse_if(not fields.flag("norm_topk_prob", True) and topk > 1, "norm_topk_prob",
                     "megamoe always renormalises top-k sigmoid gates")
    fields.refuse_if(topk == 1, "num_experts_per_tok",
                     "a single sigmoid gate renormalised to 1 is not megamoe's top-1 gate")
    first_dense = fields.whole("first_k_dense_replace", limit=arch.num_layers) if \
        config.get("first_k_dense_replace") else 0
    fields.refuse_if(first_dense == arch.num_layers, "first_k_dense_replace",
                     "every layer dense leaves no MoE layer; import it as a dense model")
    fields.refuse_if(fields.whole("moe_layer_freq", default=1) != 1, "moe_layer_freq",
                     "DeepSeek-V3 has MoE in every layer after the first dense ones")
    ffn = fields.whole("moe_intermediate_size", limit=1 << 20)
    shared = fields.whole("n_shared_experts", limit=1 << 10, default=0) if \
        config.get("n_shared_experts") else 0
    scaling = fields.positive("routed_scaling_factor", 1.0)
    moe = HFMoE(num_experts=experts, topk=topk, ffn_hidden_size=ffn,
                pattern=tuple(i >= first_dense for i in range(arch.num_layers)),
                score_function="sigmoid", shared_expert_ffn_size=shared * ffn or None,
                num_groups=groups if groups > 1 else None,
                groups_per_token=per_token if groups > 1 else None,
                group_score_topk=DEEPSEEK_GROUP_SCORE_TOPK if groups > 1 else None,
                topk_scaling_factor=None if scaling == 1.0 else scaling, expert_bias=True,
                aux_loss_coeff=DEEPSEEK_SEQ_AUX_COEFF)
    q_rank = fields.whole("q_lora_rank", limit=1 << 16) if config.get("q_lora_rank") else None
    mla = HFMLA(q_lora_rank=q_rank, kv_lora_rank=fields.whole("kv_lora_rank", limit=1 << 16),
                qk_head_dim=fields.whole("qk_nope_head_dim", limit=1 << 12),
                qk_pos_emb_head_dim=_even(fields, "qk_rope_head_dim"),
                v_head_dim=fields.whole("v_head_dim", limit=1 << 12),
                rope_interleave=fields.flag("rope_interleave", True), yarn=yarn)
    mtp = fields.whole("num_nextn_predict_layers", limit=64, default=0) if \
        config.get("num_nextn_predict_layers") else 0
    return HFMoEModel(arch, moe, mla, mtp)


def _yarn(config: dict, fields: _Fields) -> tuple[dict, dict]:
    """(config with plain RoPE, megamoe's `model.yarn`): DeepSeek's YaRN rope scaling (arXiv
    2309.00071; `rope_scaling` or transformers 5's `rope_parameters` with type yarn) as
    transformers computes it: the context factor (when null, max_position_embeddings over
    original_max_position_embeddings), beta_fast/slow, and cos/sin scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else by
    mscale(factor, 1), the softmax by mscale(factor, mscale_all_dim)^2 when set. An explicit
    `attention_factor` or an untruncated correction range (`truncate: false`) is refused."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    if not isinstance(scaling, dict) or \
            scaling.get("rope_type", scaling.get("type", "default")) != "yarn":
        return config, {}
    where = fields.where
    for name, allowed in (("attention_factor", None), ("truncate", True)):
        if scaling.get(name, allowed) != allowed:
            raise CheckpointError(f"{where}: rope scaling {name}={scaling[name]!r:.40} is not "
                                  f"supported (megamoe's YaRN takes {name}={allowed})")
    scaled = _Fields(scaling, where)
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
    all_dim = scaling.get("mscale_all_dim") or 0.0
    if all_dim:
        yarn.update(mscale=scaled.positive("mscale", 1.0),
                    mscale_all_dim=scaled.positive("mscale_all_dim", 1.0))
    theta = {"rope_theta": params.get("rope_theta", config.get("rope_theta", 10000.0))}
    return {**config, "rope_scaling": None, "rope_parameters": theta}, yarn


def _even(fields: _Fields, name: str) -> int:
    value = fields.whole(name, limit=1 << 12)
    if value % 2:
        raise CheckpointError(f"{fields.where}: {name}={value} must be even (RoPE rotates pairs)")
    return value
