"""Qwen3-MoE (`Qwen3MoeForCausalLM`) both ways.

Config: as Qwen2-MoE's (`read_qwen_moe`) without the shared expert and the QKV biases (an
`attention_bias` is refused), with per-head QK RMSNorm, and balanced over the global batch.
Tensors: Qwen2-MoE's without the shared expert, plus `self_attn.{q,k}_norm` ->
`self_attention.{q,k}_layernorm`.
"""
from __future__ import annotations

from pathlib import Path

from megamoe.checkpointing.hf.base import (MLP_NAMES, Architecture, ExportSettings, Rule,
                                           dense_mlp_rules, gqa_attention_rules, register)
from megamoe.checkpointing.hf.mixtral import check_softmax_routing, softmax_moe_rules
from megamoe.checkpointing.hf.qwen2_moe import qwen_config, read_qwen_moe
from megamoe.checkpointing.hf_moe_arch import HFMoEModel


@register
class Qwen3MoE(Architecture):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"

    def read_config(self, config: dict, where: Path) -> HFMoEModel:
        return read_qwen_moe(config, where, qwen2=False)

    def write_config(self, s: ExportSettings) -> dict:
        return {**qwen_config(self, s), "attention_bias": False}

    def check_expressible(self, s: ExportSettings) -> None:
        check_softmax_routing(self, s)
        if s.moe.shared_expert.ffn_hidden_size:
            self.refuse("a shared expert", "use qwen2_moe (shared expert with gate)")
        if s.model.add_qkv_bias:
            self.refuse("QKV biases (Qwen3-MoE's attention_bias also adds an output bias)",
                        "use qwen2_moe")
        if not s.model.qk_layernorm:
            self.refuse(f"qk_layernorm={s.model.qk_layernorm} (Qwen3-MoE always normalises Q "
                        "and K, the others never)",
                        "use qwen3_moe exactly for models with model.qk_layernorm")

    def layer_rules(self, model: HFMoEModel, index: int) -> list[Rule]:
        attention = gqa_attention_rules(model.arch)
        if not model.moe.pattern[index]:
            return attention + dense_mlp_rules(model.arch)
        return attention + softmax_moe_rules(self, model, "mlp.", MLP_NAMES)
