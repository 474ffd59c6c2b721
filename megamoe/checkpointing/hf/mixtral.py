"""Mixtral (`MixtralForCausalLM`; Jiang et al., arXiv 2401.04088) both ways.

Config: softmax top-k over `num_local_experts` with the gates renormalised over the chosen
experts, every layer MoE, experts of `intermediate_size`; a sliding window is refused.
Tensors, per layer: Llama-family attention (`gqa_attention_rules`), `block_sparse_moe.gate` ->
`mlp.router`, expert e's `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down) -> its
`linear_fc1` [w1; w3] and `linear_fc2`.

`check_softmax_routing` is the routing the softmax-family architectures (Mixtral, Qwen2-MoE,
Qwen3-MoE) share, for their `check_expressible`.
"""
from __future__ import annotations

from pathlib import Path

from megamoe.checkpointing.hf.base import (Architecture, ExportSettings, Rule, common_config,
                                           gqa_attention_rules, register, routed_experts, same)
from megamoe.checkpointing.hf_arch import parse_hf_arch
from megamoe.checkpointing.hf_moe_arch import (Fields, HFMoE, HFMoEModel, aux_coeff,
                                               check_topk)

EXPERT_BIAS_REFUSAL = ("--arch {arch} cannot express the expert bias of layer {layer} "
                       "(loss-free balancing steers selection; max |bias| {max:.3g}); train "
                       "without 'bias' in moe.balancing.methods, or use deepseek_v3")


def softmax_moe_rules(arch: Architecture, model: HFMoEModel, prefix: str,
                      expert_names: tuple[str, str, str]) -> list[Rule]:
    """A softmax-routed MoE block under HF `prefix`: its router `{prefix}gate.weight`, its
    experts `{prefix}experts.{e}.<expert_names>`, and Megatron's expert bias accepted only
    when zero (these architectures have no place for it)."""
    moe, H = model.moe, model.arch.hidden_size
    return [same(prefix + "gate.weight", "mlp.router.weight", (moe.num_experts, H)),
            Rule("mlp.router.expert_bias", (), (),
                 nonzero_refusal=EXPERT_BIAS_REFUSAL.replace("{arch}", arch.model_type)),
            *routed_experts(prefix + "experts.", expert_names, moe.num_experts,
                            moe.ffn_hidden_size, H)]


def check_softmax_routing(arch: Architecture, s: ExportSettings) -> None:
    """What the softmax-family architectures refuse: latent attention, non-softmax scores,
    group limits and a top-k scaling factor."""
    router = s.moe.router
    if s.model.multi_latent_attention:
        arch.refuse("multi-head latent attention", "use deepseek_v3")
    if router.score_function != "softmax":
        arch.refuse(f"router.score_function={router.score_function!r} routing (only softmax)",
                    "train with moe.router.score_function=softmax, or use deepseek_v3")
    if router.num_groups or router.groups_per_token:
        arch.refuse("group-limited routing (moe.router.num_groups)",
                    "train without group limits, or use deepseek_v3")
    if router.topk_scaling_factor not in (None, 1.0):
        arch.refuse(f"router.topk_scaling_factor={router.topk_scaling_factor}",
                    "train without it, or use deepseek_v3")


@register
class Mixtral(Architecture):
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"
    expert_names = ("w1", "w3", "w2")

    def read_config(self, config: dict, where: Path) -> HFMoEModel:
        fields = Fields(config, where)
        fields.refuse_if(config.get("sliding_window") is not None, "sliding_window",
                         "megamoe trains full causal attention; set it to null if the model's "
                         "context never exceeds it")
        arch = parse_hf_arch(config, where, qkv_bias=False, qk_norm=False)
        experts, topk = fields.whole("num_local_experts"), fields.whole("num_experts_per_tok")
        check_topk(fields, experts, topk)
        moe = HFMoE(num_experts=experts, topk=topk, ffn_hidden_size=arch.intermediate_size,
                    pattern=(True,) * arch.num_layers, **aux_coeff(fields))
        return HFMoEModel(arch, moe)

    def write_config(self, s: ExportSettings) -> dict:
        return {**common_config(self, s), "intermediate_size": s.moe.ffn_hidden_size,
                "num_local_experts": s.moe.num_experts, "sliding_window": None,
                "router_aux_loss_coef": s.aux_loss_coeff}

    def check_expressible(self, s: ExportSettings) -> None:
        check_softmax_routing(self, s)
        if s.moe.router.pre_softmax and s.moe.topk > 1:
            self.refuse("gates without renormalisation (moe.router.pre_softmax=true)",
                        "use qwen2_moe or qwen3_moe (norm_topk_prob=false)")
        if not all(s.pattern):
            self.refuse("dense layers between MoE layers (Mixtral has none)",
                        "use qwen2_moe or qwen3_moe (mlp_only_layers)")
        if s.model.add_qkv_bias:
            self.refuse("QKV biases", "use qwen2_moe")
        if s.moe.shared_expert.ffn_hidden_size:
            self.refuse("a shared expert", "use qwen2_moe (shared expert with gate)")
        if s.model.qk_layernorm:
            self.refuse(f"qk_layernorm={s.model.qk_layernorm} (Qwen3-MoE always normalises Q "
                        "and K, the others never)",
                        "use qwen3_moe exactly for models with model.qk_layernorm")

    def layer_rules(self, model: HFMoEModel, index: int) -> list[Rule]:
        return gqa_attention_rules(model.arch) + softmax_moe_rules(
            self, model, "block_sparse_moe.", self.expert_names)
