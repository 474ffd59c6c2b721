"""MiniMax-M2 (`MiniMaxM2ForCausalLM`, model type `minimax_m2`) both ways.

Config: every layer MoE, `num_local_experts` experts of `intermediate_size`, sigmoid scores,
the top `num_experts_per_tok` chosen by scores plus `e_score_correction_bias` (megamoe's
loss-free expert bias), their sigmoid gates always renormalised and not scaled, no groups and
no shared expert (transformers' `MiniMaxM2SparseMoeBlock`); grouped-query attention without
biases whose query and key projections are each RMS-normalised as a whole (`q_norm` over
heads x head_dim, `k_norm` over key-value heads x head_dim: megamoe's
`model.qk_layernorm_scope: projection`) before RoPE on the first `rotary_dim` channels of each
head (`model.rotary_percent`); the balance loss weight is `router_aux_loss_coef`.
Tensors, per layer (Mixtral's names): attention (`gqa_attention_rules`, its QK norms widened to
the projections), `block_sparse_moe.gate` -> `mlp.router`,
`block_sparse_moe.e_score_correction_bias` -> `mlp.router.expert_bias`, expert e's
`block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down) -> its `linear_fc1` [w1; w3] and
`linear_fc2`.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megamoe.checkpointing.hf.base import (Architecture, ExportSettings, Rule, common_config,
                                           gqa_attention_rules, register, routed_experts, same)
from megamoe.checkpointing.hf.glm4_moe import read_partial_rotary
from megamoe.checkpointing.hf_arch import parse_hf_arch
from megamoe.checkpointing.hf_moe_arch import Fields, HFMoE, HFMoEModel, aux_coeff, check_topk

EXPERT_NAMES = ("w1", "w3", "w2")
PREFIX = "block_sparse_moe."
QK_NORM_TYPE = "per_layer"
"""The release's `qk_norm_type`: one norm over each layer's whole projection."""


@register
class MiniMaxM2(Architecture):
    model_type = "minimax_m2"
    hf_class = "MiniMaxM2ForCausalLM"
    features = frozenset({"partial_rotary", "projection_qk_norm"})

    def read_config(self, config: dict, where: Path) -> HFMoEModel:
        fields = Fields(config, where)
        for name, value in (("qk_norm_type", QK_NORM_TYPE), ("scoring_func", "sigmoid")):
            fields.refuse_if(config.get(name, value) != value, name,
                             f"transformers' MiniMax-M2 computes {name}={value!r}")
        fields.refuse_if(bool(config.get("attention_bias")), "attention_bias",
                         "MiniMax-M2's attention projections have no biases")
        arch = parse_hf_arch(config, where, qkv_bias=False, qk_norm=True)
        experts, topk = fields.whole("num_local_experts"), fields.whole("num_experts_per_tok")
        check_topk(fields, experts, topk)
        fields.refuse_if(topk == 1, "num_experts_per_tok",
                         "a single sigmoid gate renormalised to 1 is not megamoe's top-1 gate")
        moe = HFMoE(num_experts=experts, topk=topk, ffn_hidden_size=arch.intermediate_size,
                    pattern=(True,) * arch.num_layers, score_function="sigmoid",
                    expert_bias=True, **aux_coeff(fields))
        rotary = read_partial_rotary(config, fields, arch.head_dim, 1.0)
        return HFMoEModel(arch, moe, model_extra={"rotary_percent": rotary,
                                                  "qk_layernorm_scope": "projection"})

    def write_config(self, s: ExportSettings) -> dict:
        m = s.model
        head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
        return {**common_config(self, s), "intermediate_size": s.moe.ffn_hidden_size,
                "num_local_experts": s.moe.num_experts,
                "rotary_dim": int(head_dim * m.rotary_percent),
                "router_aux_loss_coef": s.aux_loss_coeff}

    def check_expressible(self, s: ExportSettings) -> None:
        m, moe, router = s.model, s.moe, s.moe.router
        if m.multi_latent_attention:
            self.refuse("multi-head latent attention", "use deepseek_v3")
        if m.qk_layernorm_scope != "projection":
            self.refuse(f"model.qk_layernorm={m.qk_layernorm} per head (MiniMax-M2 normalises "
                        "the whole query and key projections)",
                        "train with model.qk_layernorm_scope=projection, or use glm4_moe")
        if m.add_qkv_bias:
            self.refuse("QKV biases", "use glm4_moe or qwen2_moe")
        if router.score_function != "sigmoid" or moe.topk < 2:
            self.refuse(f"router.score_function={router.score_function!r} with topk={moe.topk} "
                        "(MiniMax-M2 renormalises top-k sigmoid gates, k >= 2)",
                        "use mixtral, qwen2_moe or qwen3_moe")
        if router.num_groups or router.topk_scaling_factor not in (None, 1.0):
            self.refuse("group-limited or scaled gates (moe.router.num_groups / "
                        "topk_scaling_factor)", "use glm4_moe or deepseek_v3")
        if moe.shared_expert.ffn_hidden_size:
            self.refuse("a shared expert", "use glm4_moe or deepseek_v3")
        if not all(s.pattern):
            self.refuse("dense layers (MiniMax-M2 has MoE in every layer)", "use glm4_moe")

    def layer_rules(self, model: HFMoEModel, index: int) -> list[Rule]:
        a, moe = model.arch, model.moe
        widths = {"self_attn.q_norm.weight": a.num_attention_heads * a.head_dim,
                  "self_attn.k_norm.weight": a.num_key_value_heads * a.head_dim}
        attention = [replace(rule, shapes=((widths[rule.hf[0]],),))
                     if rule.hf and rule.hf[0] in widths else rule
                     for rule in gqa_attention_rules(a)]
        E, H = moe.num_experts, a.hidden_size
        return attention + [
            same(PREFIX + "gate.weight", "mlp.router.weight", (E, H)),
            same(PREFIX + "e_score_correction_bias", "mlp.router.expert_bias", (E,),
                 zeros_if_absent=True),
            *routed_experts(PREFIX + "experts.", EXPERT_NAMES, E, moe.ffn_hidden_size, H)]
