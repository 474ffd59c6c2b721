"""Qwen2-MoE (`Qwen2MoeForCausalLM`) both ways, and the config reading it shares with Qwen3-MoE.

Config (`read_qwen_moe`): softmax top-k over `num_experts`, renormalised when `norm_topk_prob`
(else the softmax over all experts, megamoe's `router.pre_softmax`); MoE layers where
`(i + 1) % decoder_sparse_step == 0` and `i` not in `mlp_only_layers`, dense ones (of
`intermediate_size`) elsewhere; experts of `moe_intermediate_size`. Qwen2-MoE adds QKV biases
(`qkv_bias`, default true) and a sigmoid-gated shared expert of
`shared_expert_intermediate_size`; the export always writes both (zero biases for a model
trained without them).
Tensors, per MoE layer: attention (`gqa_attention_rules`), `mlp.gate` -> `mlp.router`, expert
e's `mlp.experts.{e}.gate_proj|up_proj|down_proj` -> its `linear_fc1` [gate; up] and
`linear_fc2`, `mlp.shared_expert.*` -> `mlp.shared_experts.linear_fc1|fc2`,
`mlp.shared_expert_gate.weight` -> `mlp.shared_experts.gate_weight`; dense layers
`mlp.{gate,up,down}_proj` -> `mlp.linear_fc1|fc2`.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megamoe.checkpointing.hf.base import (MLP_NAMES, Architecture, ExportSettings, Rule,
                                           common_config, dense_mlp_rules, gqa_attention_rules,
                                           register, same, swiglu_mlp)
from megamoe.checkpointing.hf.mixtral import check_softmax_routing, softmax_moe_rules
from megamoe.checkpointing.hf_arch import parse_hf_arch
from megamoe.checkpointing.hf_moe_arch import (Fields, HFMoE, HFMoEModel, aux_coeff,
                                               check_topk)
from megamoe.errors import CheckpointError


def read_qwen_moe(config: dict, where: Path, qwen2: bool) -> HFMoEModel:
    """A Qwen2-MoE (`qwen2`) or Qwen3-MoE config.json (module docstring)."""
    fields = Fields(config, where)
    if not qwen2:
        fields.refuse_if(bool(config.get("attention_bias")), "attention_bias",
                         "megamoe's attention output projection has no bias")
    arch = parse_hf_arch(config, where, qkv_bias=qwen2 and fields.flag("qkv_bias", True),
                         qk_norm=not qwen2)
    # transformers 5 saves Qwen3-MoE's `num_experts` under its attribute-map name.
    experts = fields.whole("num_experts" if config.get("num_experts") is not None
                           else "num_local_experts")
    topk = fields.whole("num_experts_per_tok")
    check_topk(fields, experts, topk)
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
                global_batch_balance=not qwen2, **aux_coeff(fields))
    return HFMoEModel(arch, moe)


def qwen_config(arch: Architecture, s: ExportSettings) -> dict:
    """The config.json fields Qwen2-MoE and Qwen3-MoE share."""
    moe = s.moe
    return {**common_config(arch, s), "intermediate_size": s.model.ffn_hidden_size,
            "moe_intermediate_size": moe.ffn_hidden_size, "num_experts": moe.num_experts,
            "norm_topk_prob": not moe.router.pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, is_moe in enumerate(s.pattern) if not is_moe],
            "use_sliding_window": False, "router_aux_loss_coef": s.aux_loss_coeff}


@register
class Qwen2MoE(Architecture):
    model_type = "qwen2_moe"
    hf_class = "Qwen2MoeForCausalLM"

    def read_config(self, config: dict, where: Path) -> HFMoEModel:
        return read_qwen_moe(config, where, qwen2=True)

    def write_config(self, s: ExportSettings) -> dict:
        return {**qwen_config(self, s),
                "shared_expert_intermediate_size": s.moe.shared_expert.ffn_hidden_size,
                "qkv_bias": True}

    def check_expressible(self, s: ExportSettings) -> None:
        check_softmax_routing(self, s)
        shared = s.moe.shared_expert
        if not (shared.ffn_hidden_size and shared.gate):
            self.refuse("an MoE layer without a gated shared expert (Qwen2-MoE always has one)",
                        "use mixtral or qwen3_moe")
        if s.model.qk_layernorm:
            self.refuse(f"qk_layernorm={s.model.qk_layernorm} (Qwen3-MoE always normalises Q "
                        "and K, the others never)",
                        "use qwen3_moe exactly for models with model.qk_layernorm")

    def layer_rules(self, model: HFMoEModel, index: int) -> list[Rule]:
        a, moe = model.arch, model.moe
        attention = [replace(rule, zeros_if_absent=rule.megatron.endswith("linear_qkv.bias"))
                     for rule in gqa_attention_rules(a)]
        if not moe.pattern[index]:
            return attention + dense_mlp_rules(a)
        H = a.hidden_size
        return attention + softmax_moe_rules(self, model, "mlp.", MLP_NAMES) + swiglu_mlp(
            "mlp.shared_expert.", "mlp.shared_experts.", MLP_NAMES, moe.shared_expert_ffn_size,
            H) + [same("mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight",
                       (1, H))]
