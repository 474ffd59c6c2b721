"""GPT-OSS (`GptOssForCausalLM`; OpenAI's gpt-oss-120b/20b model card, arXiv 2508.10925) both
ways.

Config: every layer MoE over `num_local_experts` experts of `intermediate_size`; the router is a
linear layer with a bias, its top-k logits softmaxed over the chosen k (megamoe's softmax top-k
renormalised over the chosen experts: softmax over a subset is the full softmax renormalised on
it, the same function); each expert has fc1/fc2 biases and the clamped SwiGLU (`swiglu_limit`;
transformers' `swiglu_alpha` must be Megatron-Core's 1.702). Attention: grouped-query with q/k/v
and output biases (`attention_bias`), one learned sink logit per head, `layer_types` alternating
`sliding_attention` (window `sliding_window`) and `full_attention`, YaRN (`rope_parameters`,
`truncate: false`; `read_yarn`). Quantised releases (MXFP4 experts) are dequantised by the reader
(megamoe.checkpointing.quantized) under the same names and shapes as here.
Tensors, per layer: attention (`gqa_attention_rules`) plus `self_attn.o_proj.bias` ->
`self_attention.linear_proj.bias` and `self_attn.sinks` -> `self_attention.core_attention.
softmax_offset` (Megatron-Core's name for the sinks); `mlp.router.weight|bias` ->
`mlp.router.weight|bias`; all experts in one tensor each: `mlp.experts.gate_up_proj` [E, H, 2F]
(input-major, gate and up in its even and odd columns) -> `linear_fc1.weight` [E, 2F, H] with
rows [gate; up], `gate_up_proj_bias` [E, 2F] -> `linear_fc1.bias`, `down_proj` [E, F, H] ->
`linear_fc2.weight` [E, H, F], `down_proj_bias` [E, H] -> `linear_fc2.bias`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megamoe.checkpointing.hf.base import (ALL_EXPERTS, MEGATRON_EXPERTS, Architecture,
                                           ExportSettings, Rule, Transform, common_config,
                                           gqa_attention_rules, register, same)
from megamoe.checkpointing.hf.mixtral import EXPERT_BIAS_REFUSAL, check_softmax_routing
from megamoe.checkpointing.hf_arch import parse_hf_arch
from megamoe.checkpointing.hf_moe_arch import (Fields, HFMoE, HFMoEModel, aux_coeff,
                                               check_topk, read_yarn)
from megamoe.errors import CheckpointError
from megamoe.experts.activations import QUICK_GELU_ALPHA

SLIDING, FULL = "sliding_attention", "full_attention"
SINKS = "self_attention.core_attention.softmax_offset"


@dataclass(frozen=True)
class GateUpColumns(Transform):
    """GPT-OSS's fused gate/up tensor, gate and up interleaved in the even and odd entries of
    its last axis, <-> Megatron's [gate; up] halves. `transposed`: the weight, whose HF layout
    [E, H, 2F] is input-major, Megatron's [E, 2F, H] output-major; else the bias [E, 2F]."""

    transposed: bool

    def to_megatron(self, parts):
        """One new tensor, written straight from the strided halves (a released layer's fused
        weight is gigabytes)."""
        gate, up = parts[0][..., 0::2], parts[0][..., 1::2]
        if self.transposed:
            return torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], dim=1)
        return torch.cat([gate, up], dim=-1)

    def to_hf(self, tensor, shapes):
        halves = tensor.transpose(1, 2) if self.transposed else tensor
        gate, up = halves.chunk(2, dim=-1)
        fused = halves.new_empty(shapes[0])
        fused[..., 0::2], fused[..., 1::2] = gate, up
        return [fused]


@dataclass(frozen=True)
class Transposed(Transform):
    """The last two axes swapped: GPT-OSS's input-major `down_proj` [E, F, H] <-> Megatron's
    [E, H, F]."""

    def to_megatron(self, parts):
        return parts[0].transpose(-1, -2).contiguous()

    def to_hf(self, tensor, shapes):
        return [tensor.transpose(-1, -2).contiguous()]


def _sliding_layers(fields: Fields, num_layers: int) -> list[int]:
    """config.json's `layer_types` as one 0/1 per layer (1 = sliding window); absent,
    transformers' default (sliding on even layers)."""
    types = fields.config.get("layer_types")
    if types is None:
        return [int(i % 2 == 0) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or \
            any(t not in (SLIDING, FULL) for t in types):
        raise CheckpointError(f"{fields.where}: layer_types={types!r:.80} must list "
                              f"{SLIDING!r} or {FULL!r} for each of the {num_layers} layers")
    return [int(t == SLIDING) for t in types]


@register
class GptOss(Architecture):
    model_type = "gpt_oss"
    hf_class = "GptOssForCausalLM"
    activations = ("clamped_swiglu",)
    features = frozenset({"expert_bias", "router_bias", "attention_sinks", "sliding_window",
                          "linear_bias", "yarn"})

    def read_config(self, config: dict, where: Path) -> HFMoEModel:
        fields = Fields(config, where)
        alpha = config.get("swiglu_alpha", QUICK_GELU_ALPHA)
        fields.refuse_if(alpha != QUICK_GELU_ALPHA, "swiglu_alpha",
                         f"megamoe's clamped SwiGLU, as Megatron-Core's quick_gelu, has gain "
                         f"{QUICK_GELU_ALPHA}")
        limit = fields.positive("swiglu_limit", 7.0)
        bias = fields.flag("attention_bias", True)
        plain_rope, yarn = read_yarn(config, fields)
        arch = parse_hf_arch(plain_rope, where, qkv_bias=bias, qk_norm=False)
        experts, topk = fields.whole("num_local_experts"), fields.whole("num_experts_per_tok")
        check_topk(fields, experts, topk)
        sliding = _sliding_layers(fields, arch.num_layers)
        window = None
        if any(sliding):
            window = fields.whole("sliding_window", limit=1 << 24, default=0)
            fields.refuse_if(window == 0, "sliding_window",
                             "layer_types has sliding_attention layers but no window")
        moe = HFMoE(num_experts=experts, topk=topk, ffn_hidden_size=arch.intermediate_size,
                    pattern=(True,) * arch.num_layers, **aux_coeff(fields))
        model_extra = {"add_bias_linear": bias, "attention_sinks": True,
                       "sliding_window": window,
                       "sliding_window_layers": sliding if window else None}
        if yarn:
            model_extra["yarn"] = yarn
        return HFMoEModel(arch, moe, model_extra=model_extra, moe_extra={
            "experts": {"activation": "clamped_swiglu", "swiglu_limit": limit, "bias": True},
            "router": {"bias": True}})

    def write_config(self, s: ExportSettings) -> dict:
        m, moe = s.model, s.moe
        out = {**common_config(self, s), "intermediate_size": moe.ffn_hidden_size,
               "num_local_experts": moe.num_experts, "attention_bias": m.add_qkv_bias,
               "swiglu_limit": moe.experts.swiglu_limit, "swiglu_alpha": QUICK_GELU_ALPHA,
               "router_aux_loss_coef": s.aux_loss_coeff}
        layers = m.sliding_window_layers or [1] * m.num_layers
        out["layer_types"] = [SLIDING if m.sliding_window and sliding else FULL
                              for sliding in layers]
        out["sliding_window"] = m.sliding_window
        # transformers' GptOssConfig takes YaRN x32 when no rope_parameters are given.
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": out.pop("rope_theta")}
        if s.yarn:
            scaled = {key: s.yarn[key] for key in ("factor", "original_max_position_embeddings",
                                                   "beta_fast", "beta_slow")}
            if s.yarn["mscale"] and s.yarn["mscale_all_dim"]:  # else transformers' default
                scaled.update(mscale=s.yarn["mscale"], mscale_all_dim=s.yarn["mscale_all_dim"])
            # `model.yarn.truncate` (megamoe.train.settings.model.yarn_truncates; default true)
            truncate = bool(m.yarn.get("truncate", True))
            out["rope_parameters"].update(rope_type="yarn", truncate=truncate, **scaled)
        return out

    def check_expressible(self, s: ExportSettings) -> None:
        m, moe = s.model, s.moe
        check_softmax_routing(self, s)
        if moe.router.pre_softmax and moe.topk > 1:
            self.refuse("gates without renormalisation (moe.router.pre_softmax=true)",
                        "GPT-OSS softmaxes the chosen experts' logits: train with "
                        "moe.router.pre_softmax=false")
        if not all(s.pattern):
            self.refuse("dense layers (every GPT-OSS layer is MoE)", "use qwen2_moe or "
                        "qwen3_moe (mlp_only_layers)")
        if moe.shared_expert.ffn_hidden_size:
            self.refuse("a shared expert", "use qwen2_moe")
        for name, wanted in (("moe.experts.bias", moe.experts.bias),
                             ("moe.router.bias", moe.router.bias),
                             ("model.attention_sinks", m.attention_sinks)):
            if not wanted:
                self.refuse(f"a model without {name} (GPT-OSS always has it)",
                            f"train with {name}=true")
        if m.add_qkv_bias != m.add_bias_linear:
            self.refuse(f"model.add_qkv_bias={m.add_qkv_bias} with model.add_bias_linear="
                        f"{m.add_bias_linear} (GPT-OSS's attention_bias covers q, k, v and o)",
                        "set both alike")
        if m.qk_layernorm:
            self.refuse(f"qk_layernorm={m.qk_layernorm}", "use qwen3_moe")
        if m.rope_scaling_factor is not None:
            self.refuse(f"Llama 3 rope scaling (model.rope_scaling_factor="
                        f"{m.rope_scaling_factor})", "GPT-OSS scales RoPE with YaRN")

    def layer_rules(self, model: HFMoEModel, index: int) -> list[Rule]:
        a, moe = model.arch, model.moe
        E, H, F = moe.num_experts, a.hidden_size, moe.ffn_hidden_size
        rules = gqa_attention_rules(a) + [same("self_attn.sinks", SINKS,
                                               (a.num_attention_heads,))]
        if a.qkv_bias:
            rules.append(same("self_attn.o_proj.bias", "self_attention.linear_proj.bias", (H,)))
        experts = "mlp.experts."
        return rules + [
            same("mlp.router.weight", "mlp.router.weight", (E, H)),
            same("mlp.router.bias", "mlp.router.bias", (E,)),
            Rule("mlp.router.expert_bias", (), (),
                 nonzero_refusal=EXPERT_BIAS_REFUSAL.replace("{arch}", self.model_type)),
            Rule(MEGATRON_EXPERTS + "linear_fc1.weight", (experts + "gate_up_proj",),
                 ((E, H, 2 * F),), GateUpColumns(transposed=True), expert=ALL_EXPERTS),
            Rule(MEGATRON_EXPERTS + "linear_fc1.bias", (experts + "gate_up_proj_bias",),
                 ((E, 2 * F),), GateUpColumns(transposed=False), expert=ALL_EXPERTS),
            Rule(MEGATRON_EXPERTS + "linear_fc2.weight", (experts + "down_proj",), ((E, F, H),),
                 Transposed(), expert=ALL_EXPERTS),
            Rule(MEGATRON_EXPERTS + "linear_fc2.bias", (experts + "down_proj_bias",), ((E, H),),
                 expert=ALL_EXPERTS)]
