"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, arXiv 2412.19437; Kimi-K2 ships this architecture at
other sizes) both ways.

Config: sigmoid scores, selection by scores plus `e_score_correction_bias` (megamoe's loss-free
expert bias, arXiv 2408.15664, which keeps training from the imported values) within the
`topk_group` best of `n_group` groups, each scored by its top-2 biased scores (megamoe's
`router.group_score_topk`), gates renormalised (`norm_topk_prob`) and scaled by
`routed_scaling_factor`; `n_shared_experts` ungated shared experts; the first
`first_k_dense_replace` layers dense; MLA with low-rank q (`q_lora_rank`, or a full q projection
when null) and kv (`kv_lora_rank`) projections, RMSNorm on both latents, and decoupled RoPE
(`qk_rope_head_dim`) on DeepSeek's interleaved pairs (`rope_interleave`; a source without it
has its RoPE rows permuted, `RopeInterleave`); YaRN (`read_yarn`). `num_nextn_predict_layers`
announces the multi-token-prediction layers (megamoe.checkpointing.hf.mtp).
Tensors, per layer (HF `model.layers.{l}.` -> Megatron `decoder.layers.{l}.`): `q_a_proj` ->
`linear_q_down_proj`, `q_a_layernorm` -> `q_layernorm`, `q_b_proj` -> `linear_q_up_proj` (or
`q_proj` -> `linear_q_proj` without a q rank), `kv_a_proj_with_mqa` -> `linear_kv_down_proj`,
`kv_a_layernorm` -> `kv_layernorm`, `kv_b_proj` -> `linear_kv_up_proj`, `o_proj` ->
`linear_proj` (all under `self_attn.` / `self_attention.`); `input_layernorm`,
`post_attention_layernorm` -> `pre_mlp_layernorm`; `mlp.gate.weight` / `.e_score_correction_bias`
-> `mlp.router.weight` / `.expert_bias` (fp32); experts as Qwen's; `mlp.shared_experts.*` ->
`mlp.shared_experts.linear_fc1|fc2`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megamoe.checkpointing.hf.base import (IDENTITY, MLP_NAMES, Architecture, ExportSettings,
                                           Rule, Transform, common_config, dense_mlp_rules,
                                           register, routed_experts, same, swiglu_mlp)
from megamoe.checkpointing.hf_arch import parse_hf_arch
from megamoe.checkpointing.hf_moe_arch import (DEEPSEEK_GROUP_SCORE_TOPK,
                                               DEEPSEEK_SEQ_AUX_COEFF, HFMLA, Fields, HFMoE,
                                               HFMoEModel, check_topk, read_yarn)
from megamoe.errors import CheckpointError


@dataclass(frozen=True)
class RopeInterleave(Transform):
    """Rows in groups of `period` (one per head, or one group); in each, the RoPE rows from
    `start` on go from rotate-half order [x_0..x_{d/2-1}, y_0..] (a DeepSeek source without
    `rope_interleave`) to interleaved pairs [x_0, y_0, x_1, y_1, ...], the order Megatron's MLA
    rotates; the inverse reorders them back."""

    period: int
    start: int

    def _rope(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grouped = tensor.reshape(-1, self.period, *tensor.shape[1:]).clone()
        return grouped, grouped[:, self.start:]

    def to_megatron(self, parts):
        grouped, rope = self._rope(parts[0])
        half = rope.shape[1] // 2
        grouped[:, self.start:] = torch.stack([rope[:, :half], rope[:, half:]],
                                              dim=2).reshape(rope.shape)
        return grouped.reshape(parts[0].shape)

    def to_hf(self, tensor, shapes):
        grouped, rope = self._rope(tensor)
        half = rope.shape[1] // 2
        pairs = rope.reshape(rope.shape[0], half, 2, *rope.shape[2:])
        grouped[:, self.start:] = pairs.transpose(1, 2).reshape(rope.shape)
        return [grouped.reshape(tensor.shape)]


def _even(fields: Fields, name: str) -> int:
    value = fields.whole(name, limit=1 << 12)
    if value % 2:
        raise CheckpointError(f"{fields.where}: {name}={value} must be even (RoPE rotates pairs)")
    return value


def read_sigmoid_moe(config: dict, fields: Fields, num_layers: int) -> HFMoE:
    """DeepSeek-V3's routed layers (module docstring), which GLM-4.5 shares: `n_routed_experts`
    of `moe_intermediate_size`, sigmoid top-k renormalised, group limits, scaling, ungated
    shared experts and the first `first_k_dense_replace` of `num_layers` layers dense."""
    experts, topk = fields.whole("n_routed_experts"), fields.whole("num_experts_per_tok")
    check_topk(fields, experts, topk)
    groups = fields.whole("n_group", default=1)
    per_token = fields.whole("topk_group", default=1)
    if experts % groups or per_token > groups:
        raise CheckpointError(f"{fields.where}: n_group={groups} / topk_group={per_token} do not "
                              f"split {experts} experts; the config is inconsistent")
    if groups > 1 and (experts // groups < DEEPSEEK_GROUP_SCORE_TOPK
                       or topk > per_token * experts // groups):
        raise CheckpointError(f"{fields.where}: n_group={groups} / topk_group={per_token} leave "
                              f"groups of fewer than {DEEPSEEK_GROUP_SCORE_TOPK} experts or "
                              f"fewer than num_experts_per_tok={topk} experts to choose "
                              "from; the config is inconsistent")
    fields.refuse_if(not fields.flag("norm_topk_prob", True) and topk > 1, "norm_topk_prob",
                     "megamoe always renormalises top-k sigmoid gates")
    fields.refuse_if(topk == 1, "num_experts_per_tok",
                     "a single sigmoid gate renormalised to 1 is not megamoe's top-1 gate")
    first_dense = fields.whole("first_k_dense_replace", limit=num_layers) if \
        config.get("first_k_dense_replace") else 0
    fields.refuse_if(first_dense == num_layers, "first_k_dense_replace",
                     "every layer dense leaves no MoE layer; import it as a dense model")
    fields.refuse_if(fields.whole("moe_layer_freq", default=1) != 1, "moe_layer_freq",
                     "DeepSeek-V3 and GLM-4.5 have MoE in every layer after the first dense ones")
    ffn = fields.whole("moe_intermediate_size", limit=1 << 20)
    shared = fields.whole("n_shared_experts", limit=1 << 10, default=0) if \
        config.get("n_shared_experts") else 0
    scaling = fields.positive("routed_scaling_factor", 1.0)
    return HFMoE(num_experts=experts, topk=topk, ffn_hidden_size=ffn,
                 pattern=tuple(i >= first_dense for i in range(num_layers)),
                 score_function="sigmoid", shared_expert_ffn_size=shared * ffn or None,
                 num_groups=groups if groups > 1 else None,
                 groups_per_token=per_token if groups > 1 else None,
                 group_score_topk=DEEPSEEK_GROUP_SCORE_TOPK if groups > 1 else None,
                 topk_scaling_factor=None if scaling == 1.0 else scaling, expert_bias=True,
                 aux_loss_coeff=DEEPSEEK_SEQ_AUX_COEFF)


def sigmoid_moe_config(s: ExportSettings) -> dict:
    """The config.json fields of `read_sigmoid_moe`'s routed layers, from the trained settings."""
    moe, router = s.moe, s.moe.router
    return {"intermediate_size": s.model.ffn_hidden_size,
            "moe_intermediate_size": moe.ffn_hidden_size, "n_routed_experts": moe.num_experts,
            "n_shared_experts": (moe.shared_expert.ffn_hidden_size or 0) // moe.ffn_hidden_size,
            "routed_scaling_factor": router.topk_scaling_factor or 1.0,
            "n_group": router.num_groups or 1, "topk_group": router.groups_per_token or 1,
            "norm_topk_prob": True, "first_k_dense_replace": s.pattern.index(True)}


def check_sigmoid_moe(arch: Architecture, s: ExportSettings) -> None:
    """Refuse what `read_sigmoid_moe`'s routed layers cannot hold: other scores than top-k
    (k >= 2) renormalised sigmoid gates, groups not scored by their top 2, gated or fractional
    shared experts, dense layers after the first MoE layer."""
    moe, router, name = s.moe, s.moe.router, arch.model_type
    if router.score_function != "sigmoid" or moe.topk < 2:
        arch.refuse(f"router.score_function={router.score_function!r} with topk={moe.topk} "
                    f"({name} renormalises top-k sigmoid gates, k >= 2)",
                    "use mixtral, qwen2_moe or qwen3_moe")
    scoring = router.num_groups and router.experts_scoring_a_group(moe.topk)
    if scoring and scoring != DEEPSEEK_GROUP_SCORE_TOPK:
        arch.refuse(f"groups scored by their top {scoring} experts "
                    f"({name} scores by the top {DEEPSEEK_GROUP_SCORE_TOPK})",
                    f"train with moe.router.group_score_topk={DEEPSEEK_GROUP_SCORE_TOPK}")
    shared = moe.shared_expert.ffn_hidden_size or 0
    if moe.shared_expert.gate or shared % moe.ffn_hidden_size:
        arch.refuse(f"a shared expert of size {shared} (gate {moe.shared_expert.gate}; "
                    f"{name} has ungated shared experts of whole expert sizes)",
                    "train with moe.shared_expert.gate=false and a multiple of "
                    "moe.ffn_hidden_size")
    first_moe = s.pattern.index(True)
    if not all(s.pattern[first_moe:]):
        arch.refuse(f"dense layers after the first MoE layer ({name} has only leading dense "
                    "layers)", "use qwen2_moe or qwen3_moe (mlp_only_layers)")


def sigmoid_moe_rules(model: HFMoEModel) -> list[Rule]:
    """A MoE layer's tensors of `read_sigmoid_moe`'s models (module docstring): router, fp32
    correction bias, routed and shared experts."""
    moe, H = model.moe, model.arch.hidden_size
    E = moe.num_experts
    rules = [same("mlp.gate.weight", "mlp.router.weight", (E, H)),
             same("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias", (E,),
                  dtype=torch.float32, zeros_if_absent=True),
             *routed_experts("mlp.experts.", MLP_NAMES, E, moe.ffn_hidden_size, H)]
    if moe.shared_expert_ffn_size:
        rules += swiglu_mlp("mlp.shared_experts.", "mlp.shared_experts.", MLP_NAMES,
                            moe.shared_expert_ffn_size, H)
    return rules


@register
class DeepSeekV3(Architecture):
    model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    features = frozenset({"mtp", "yarn"})

    def read_config(self, config: dict, where: Path) -> HFMoEModel:
        fields = Fields(config, where)
        fields.refuse_if(bool(config.get("attention_bias")), "attention_bias",
                         "megamoe's MLA projections have no biases")
        # DeepSeek-V3's own config.json names its routing (transformers always runs this one);
        # DeepSeek-V2's softmax / greedy routing is another model.
        fields.refuse_if(config.get("scoring_func", "sigmoid") != "sigmoid", "scoring_func",
                         "DeepSeek-V3 routes by sigmoid scores")
        fields.refuse_if(config.get("topk_method", "noaux_tc") != "noaux_tc", "topk_method",
                         "DeepSeek-V3 selects by noaux_tc: scores plus the correction bias")
        # `head_dim` of a DeepSeek config is the RoPE width, not an attention head size.
        plain_rope, yarn = read_yarn(config, fields)
        arch = parse_hf_arch({**plain_rope, "head_dim": None}, where, qkv_bias=False,
                             qk_norm=False)
        if arch.num_key_value_heads != arch.num_attention_heads:
            raise CheckpointError(f"{where}: num_key_value_heads={arch.num_key_value_heads} "
                                  f"must equal num_attention_heads={arch.num_attention_heads} "
                                  "for MLA")
        moe = read_sigmoid_moe(config, fields, arch.num_layers)
        q_rank = fields.whole("q_lora_rank", limit=1 << 16) if config.get("q_lora_rank") \
            else None
        mla = HFMLA(q_lora_rank=q_rank, kv_lora_rank=fields.whole("kv_lora_rank", limit=1 << 16),
                    qk_head_dim=fields.whole("qk_nope_head_dim", limit=1 << 12),
                    qk_pos_emb_head_dim=_even(fields, "qk_rope_head_dim"),
                    v_head_dim=fields.whole("v_head_dim", limit=1 << 12),
                    rope_interleave=fields.flag("rope_interleave", True), yarn=yarn)
        mtp = fields.whole("num_nextn_predict_layers", limit=64, default=0) if \
            config.get("num_nextn_predict_layers") else 0
        return HFMoEModel(arch, moe, mla, mtp)

    def write_config(self, s: ExportSettings) -> dict:
        m = s.model
        out = {**common_config(self, s), **sigmoid_moe_config(s),
               "num_key_value_heads": m.num_attention_heads, "head_dim": m.qk_pos_emb_head_dim,
               "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
               "qk_nope_head_dim": m.qk_head_dim, "qk_rope_head_dim": m.qk_pos_emb_head_dim,
               "v_head_dim": m.v_head_dim, "rope_interleave": True, "attention_bias": False,
               "num_nextn_predict_layers": s.mtp_layers}
        if s.yarn:
            out["rope_scaling"] = {"type": "yarn", **s.yarn}
            if not s.model.yarn.get("truncate", True):
                out["rope_scaling"]["truncate"] = False
        return out

    def check_expressible(self, s: ExportSettings) -> None:
        if not s.model.multi_latent_attention:
            self.refuse("grouped-query attention (DeepSeek-V3 has multi-head latent attention)",
                        "use mixtral, qwen2_moe, qwen3_moe or glm4_moe")
        check_sigmoid_moe(self, s)

    def layer_rules(self, model: HFMoEModel, index: int) -> list[Rule]:
        rules = self.attention_rules(model)
        if not model.moe.pattern[index]:
            return rules + dense_mlp_rules(model.arch)
        return rules + sigmoid_moe_rules(model)

    @staticmethod
    def attention_rules(model: HFMoEModel) -> list[Rule]:
        """Multi-head latent attention and the layer's two norms (module docstring)."""
        a, mla = model.arch, model.mla
        H, heads, rope = a.hidden_size, a.num_attention_heads, mla.qk_pos_emb_head_dim
        qk, kv_rank = mla.qk_head_dim + rope, mla.kv_lora_rank
        q_rope = IDENTITY if mla.rope_interleave else RopeInterleave(qk, mla.qk_head_dim)
        kv_rope = IDENTITY if mla.rope_interleave else RopeInterleave(kv_rank + rope, kv_rank)
        sa, at = "self_attn.", "self_attention."
        rules = [same("input_layernorm.weight", "input_layernorm.weight", (H,)),
                 same("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", (H,),
                      aliases=("mlp.linear_fc1.layer_norm_weight",)),
                 Rule(at + "linear_kv_down_proj.weight", (sa + "kv_a_proj_with_mqa.weight",),
                      ((kv_rank + rope, H),), kv_rope),
                 same(sa + "kv_a_layernorm.weight", at + "kv_layernorm.weight", (kv_rank,)),
                 same(sa + "kv_b_proj.weight", at + "linear_kv_up_proj.weight",
                      (heads * (mla.qk_head_dim + mla.v_head_dim), kv_rank)),
                 same(sa + "o_proj.weight", at + "linear_proj.weight", (H, heads * mla.v_head_dim))]
        if mla.q_lora_rank is None:
            return rules + [Rule(at + "linear_q_proj.weight", (sa + "q_proj.weight",),
                                 ((heads * qk, H),), q_rope)]
        q_rank = mla.q_lora_rank
        return rules + [same(sa + "q_a_proj.weight", at + "linear_q_down_proj.weight",
                             (q_rank, H)),
                        same(sa + "q_a_layernorm.weight", at + "q_layernorm.weight", (q_rank,)),
                        Rule(at + "linear_q_up_proj.weight", (sa + "q_b_proj.weight",),
                             ((heads * qk, q_rank),), q_rope)]
