"""GLM-4.5 (`Glm4MoeForCausalLM`, model type `glm4_moe`; also GLM-4.5-Air, 4.6 and 4.7) both ways.

Config: DeepSeek-V3's routed layers (`read_sigmoid_moe`: sigmoid scores, selection by scores
plus `e_score_correction_bias` within the `topk_group` best of `n_group` groups, gates
renormalised and scaled by `routed_scaling_factor`, `n_shared_experts` ungated shared experts,
the first `first_k_dense_replace` layers dense) around grouped-query attention with biases on
q/k/v (`attention_bias`), an optional per-head QK RMSNorm (`use_qk_norm`) and RoPE on the first
`partial_rotary_factor` of each head's channels (default 0.5, as transformers reads a config
without it; megamoe's `model.rotary_percent`). `num_nextn_predict_layers` announces the
multi-token-prediction layers (megamoe.checkpointing.hf.mtp).
Tensors, per layer: Llama-family attention (`gqa_attention_rules`: `self_attn.{q,k,v}_proj`
weights and biases -> `self_attention.linear_qkv`, `{q,k}_norm` -> `{q,k}_layernorm`),
DeepSeek-V3's MoE layer (`sigmoid_moe_rules`: `mlp.gate` -> `mlp.router`, its correction bias
-> `mlp.router.expert_bias`, `mlp.experts.{e}.*`, `mlp.shared_experts.*`) or dense MLP.

`read_partial_rotary` is the rotary fraction as transformers reads it, for MiniMax-M2 too.
"""
from __future__ import annotations

from pathlib import Path

from megamoe.checkpointing.hf.base import (Architecture, ExportSettings, Rule, common_config,
                                           dense_mlp_rules, gqa_attention_rules, register)
from megamoe.checkpointing.hf.deepseek_v3 import (check_sigmoid_moe, read_sigmoid_moe,
                                                  sigmoid_moe_config, sigmoid_moe_rules)
from megamoe.checkpointing.hf_arch import parse_hf_arch
from megamoe.checkpointing.hf_moe_arch import Fields, HFMoEModel
from megamoe.errors import CheckpointError

GLM_ROTARY_FRACTION = 0.5
"""The rotary fraction transformers gives a GLM-4.5 config that names none."""


def read_partial_rotary(config: dict, fields: Fields, head_dim: int, default: float) -> float:
    """The fraction of each head's channels RoPE rotates, as transformers reads it:
    `rope_parameters.partial_rotary_factor`, else a top-level `partial_rotary_factor`, else
    MiniMax's `rotary_dim` over `head_dim`, else `default`; refused unless the rotated channels
    are an even count of at least 2 that fits the head."""
    params = config.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    if params.get("partial_rotary_factor") is not None:
        fraction = Fields(params, fields.where).positive("partial_rotary_factor", default)
    elif config.get("partial_rotary_factor") is not None:
        fraction = fields.positive("partial_rotary_factor", default)
    elif config.get("rotary_dim") is not None:
        fraction = fields.whole("rotary_dim", limit=head_dim) / head_dim
    else:
        fraction = default
    rotated = int(head_dim * fraction)
    if fraction > 1 or rotated < 2 or rotated % 2:
        raise CheckpointError(f"{fields.where}: partial_rotary_factor / rotary_dim give "
                              f"{rotated} rotated channels of a {head_dim}-channel head; RoPE "
                              "needs an even count from 2 to the head size")
    return fraction


@register
class Glm4Moe(Architecture):
    model_type = "glm4_moe"
    hf_class = "Glm4MoeForCausalLM"
    features = frozenset({"mtp", "partial_rotary"})

    def read_config(self, config: dict, where: Path) -> HFMoEModel:
        fields = Fields(config, where)
        arch = parse_hf_arch(config, where, qkv_bias=fields.flag("attention_bias", False),
                             qk_norm=fields.flag("use_qk_norm", False))
        moe = read_sigmoid_moe(config, fields, arch.num_layers)
        mtp = fields.whole("num_nextn_predict_layers", limit=64, default=0) if \
            config.get("num_nextn_predict_layers") else 0
        rotary = read_partial_rotary(config, fields, arch.head_dim, GLM_ROTARY_FRACTION)
        return HFMoEModel(arch, moe, mtp_layers=mtp, model_extra={"rotary_percent": rotary})

    def write_config(self, s: ExportSettings) -> dict:
        m = s.model
        return {**common_config(self, s), **sigmoid_moe_config(s),
                "partial_rotary_factor": m.rotary_percent, "attention_bias": m.add_qkv_bias,
                "use_qk_norm": m.qk_layernorm, "num_nextn_predict_layers": s.mtp_layers}

    def check_expressible(self, s: ExportSettings) -> None:
        if s.model.multi_latent_attention:
            self.refuse("multi-head latent attention", "use deepseek_v3")
        check_sigmoid_moe(self, s)

    def layer_rules(self, model: HFMoEModel, index: int) -> list[Rule]:
        attention = gqa_attention_rules(model.arch)
        if not model.moe.pattern[index]:
            return attention + dense_mlp_rules(model.arch)
        return attention + sigmoid_moe_rules(model)
