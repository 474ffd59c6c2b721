"""The GPT model of a training run: a Megatron-Core GPTModel with megamoe layers in the MLP slots.

`transformer_config` maps the run's `model`, `moe`, `parallel` and `training` sections onto
Megatron-Core's TransformerConfig, whose MoE fields say what Megatron-Core itself acts on
(`megamoe.megatron.fields.HOST_LINKS`). Every megamoe layer is configured by its MoEConfig
object, which the decoder block spec carries into it (`gpt_decoder_block_spec`). Who ends each
step's balancing is decided here, once: megamoe's `step_balancing`, which the loop calls once
per optimizer step (`StepOwner.STEP_BALANCING`), so Megatron's own expert-bias update stays off
(`moe_router_enable_expert_bias=False`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megamoe.balancing.owner import StepOwner
from megamoe.config import moe_layer_pattern
from megamoe.megatron.cpu import cuda_as_cpu
from megamoe.megatron.fields import HOST_LINKS, transformer_config_settings
from megamoe.megatron.seeded_init import initialise_weights
from megamoe.megatron.sink_attention import window_settings
from megamoe.megatron.specs import (gpt_decoder_block_spec, mtp_block_spec,
                                    transformer_engine_available)
from megamoe.train.config import TrainConfig, yarn_settings
from megamoe.train.settings.model import yarn_truncates


STEP_OWNER = StepOwner.STEP_BALANCING
"""The trainer's loop calls `step_balancing` once per optimizer step (`megamoe.train.loop`)."""


def padded_vocab_size(vocab_size: int, config: TrainConfig) -> int:
    """The tokenizer's vocabulary rounded up so the embedding splits evenly over tensor ranks."""
    multiple = config.model.make_vocab_size_divisible_by * config.parallel.tensor
    return -(-vocab_size // multiple) * multiple


def transformer_config(config: TrainConfig, on_cuda: bool, bf16: bool) -> TransformerConfig:
    """Megatron-Core's TransformerConfig of the run (fp32 on CPU, bf16 or fp32 on CUDA); an
    MLATransformerConfig with `model.multi_latent_attention`."""
    m, p = config.model, config.parallel
    moe = config.moe_config()
    kind = MLATransformerConfig if m.multi_latent_attention else TransformerConfig
    tc = kind(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        qk_layernorm=m.qk_layernorm or m.multi_latent_attention,
        kv_channels=m.kv_channels,
        add_qkv_bias=m.add_qkv_bias,
        **latent_attention_settings(config),
        layernorm_epsilon=m.norm_epsilon,
        add_bias_linear=m.add_bias_linear,
        # GPT-OSS's attention (`megamoe.megatron.sink_attention`): sinks, sliding windows.
        softmax_type="learnable" if m.attention_sinks else "vanilla",
        **window_settings(m.sliding_window, m.sliding_window_layers),
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        expert_model_parallel_size=p.expert,
        # megamoe's experts are never tensor-parallel (setup_megatron's groups); Megatron checks
        # it for expert biases.
        expert_tensor_parallel_size=1,
        virtual_pipeline_model_parallel_size=p.virtual_stages if p.virtual_stages > 1 else None,
        num_layers_in_first_pipeline_stage=p.first_stage_layers,
        num_layers_in_last_pipeline_stage=p.last_stage_layers,
        sequence_parallel=p.tensor > 1,
        # gloo has no batched (coalesced) point-to-point; one op at a time works on both.
        batch_p2p_comm=on_cuda,
        **_recompute_settings(config),
        # Only the MoE settings Megatron-Core acts on around megamoe's layers (expert counts and
        # sizes, the balancing it would do in finalize_model_grads): Megatron builds no router,
        # dispatcher or experts of its own here, so its router fields keep their defaults and
        # its checks of its own router (e.g. "softmax top-1 needs --moe-router-pre-softmax")
        # are not made of megamoe's routers, which the spec's MoEConfig objects configure.
        **transformer_config_settings(moe, STEP_OWNER, HOST_LINKS),
        moe_layer_freq=moe_layer_freq(config),
        # Multi-token prediction (DeepSeek-V3, sec. 2.2) through Megatron-Core's own MTP block.
        mtp_num_layers=m.mtp_layers or None,
        mtp_loss_scaling_factor=m.mtp_loss_weight,
        use_cpu_initialization=not on_cuda,
        # What the decoder spec builds; Megatron's modules that pick their own implementation
        # (0.19's MLA latent norms) then pick the local one without Transformer Engine.
        transformer_impl="transformer_engine" if transformer_engine_available() else "local",
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    # megamoe's own attention setting, which TransformerConfig has no field for: the specs read
    # it from the config as they read Megatron's (`megamoe.megatron.specs._base_layer_spec`).
    tc.qk_layernorm_scope = m.qk_layernorm_scope
    for name, value in grouped_yarn_attributes(config).items():
        setattr(tc, name, value)
    return tc


def latent_attention_settings(config: TrainConfig) -> dict:
    """MLATransformerConfig's fields for `model.multi_latent_attention` (none without it): the
    latent sizes, and RoPE on `model.rotary_base`, YaRN-extended with `model.yarn` (arXiv
    2309.00071; its factor also scales the softmax as DeepSeek-V2 does, with `mscale_all_dim`).
    Plain RoPE takes scaling factor 1, which leaves the softmax scale at
    1/sqrt(qk_head_dim + qk_pos_emb_head_dim)."""
    m = config.model
    if not m.multi_latent_attention:
        return {}
    rope = dict(rope_type="rope", rotary_scaling_factor=1.0)
    if m.yarn:
        yarn = yarn_settings(m.yarn)
        rope = dict(rope_type="yarn", rotary_scaling_factor=float(yarn.pop("factor")), **yarn)
    return dict(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
                v_head_dim=m.v_head_dim, rotary_base=m.rotary_base, **rope)


def grouped_yarn_attributes(config: TrainConfig) -> dict:
    """The TransformerConfig attributes through which Megatron-Core's GPTModel
    (`position_embedding_type="yarn"`) and attention read YaRN (arXiv 2309.00071) for
    grouped-query attention (0.16.1, 0.19.2: with getattr; TransformerConfig declares none of
    them), from `model.yarn`; none without it, or with MLA (`latent_attention_settings`).
    The inverse frequencies are transformers' `_compute_yarn_parameters` (`truncate: false`
    leaves the correction range unrounded), cos and sin scaled by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are non-zero, else (Megatron's rule when they are
    unset) by 0.1 ln(factor) + 1, as transformers does."""
    m = config.model
    if not m.yarn or m.multi_latent_attention:
        return {}
    yarn = yarn_settings(m.yarn)
    both = bool(yarn["mscale"] and yarn["mscale_all_dim"])
    return dict(yarn_rotary_scaling_factor=float(yarn["factor"]),
                yarn_original_max_position_embeddings=yarn["original_max_position_embeddings"],
                yarn_beta_fast=float(yarn["beta_fast"]), yarn_beta_slow=float(yarn["beta_slow"]),
                yarn_mscale=float(yarn["mscale"]) if both else None,
                yarn_mscale_all_dim=float(yarn["mscale_all_dim"]) if both else None,
                yarn_correction_range_round_to_int=yarn_truncates(m.yarn))


def position_embedding_type(config: TrainConfig) -> str:
    """GPTModel's `position_embedding_type`: `model.position_embedding`, or "yarn" for
    grouped-query attention with `model.yarn` (MLA applies its own RoPE and YaRN)."""
    m = config.model
    return "yarn" if m.yarn and not m.multi_latent_attention else m.position_embedding


def _recompute_settings(config: TrainConfig) -> dict:
    """Megatron-Core's activation recomputation from `training.recompute`: `full` recomputes
    every transformer layer (uniform, one layer per checkpoint), `selective` the
    `training.recompute_modules` of each layer (`mlp` covers megamoe's MoE layers)."""
    t = config.training
    if t.recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)
    if t.recompute == "selective":
        return dict(recompute_granularity="selective",
                    recompute_modules=list(t.recompute_modules))
    return {}


def moe_layer_freq(config: TrainConfig) -> int | list[int]:
    """`model.moe_layer_freq`, with `model.first_k_dense` folded in as Megatron-LM expresses
    dense-first models (a 0/1 list), which also gives their checkpoints Megatron's per-layer
    key layout."""
    m = config.model
    if m.first_k_dense == 0:
        return m.moe_layer_freq
    return [int(is_moe) for is_moe in moe_layer_pattern(m, m.first_k_dense)]


def sharded_state_metadata(config: TrainConfig) -> dict:
    """Metadata for `GPTModel.sharded_state_dict`: this rank's data-parallel group (a last
    pipeline stage's copy of the embedding, kept for multi-token prediction, names it in its
    replica id), and per-layer keys when MoE layers differ in shape (`moe.layer_overrides`),
    since a stacked layer axis needs equal shapes."""
    metadata = {"non_homogeneous_layers": True} if config.moe.layer_overrides else {}
    return ensure_metadata_has_dp_cp_group(metadata)


def build_model(config: TrainConfig, tc: TransformerConfig, vocab_size: int
                ) -> list[GPTModel]:
    """This pipeline rank's GPTModel chunks, one per virtual stage (`parallel.virtual_stages`):
    dense and megamoe layers as `model.first_k_dense` and `model.moe_layer_freq` say, per-layer
    MoE overrides from `moe.layer_overrides`. Their initial weights are those of
    `training.seed` whatever the layout (`megamoe.megatron.seeded_init`). On the CPU they are
    built under `cuda_as_cpu`: a last pipeline stage holding a copy of the embedding (for
    multi-token prediction or tied embeddings) has Megatron move it to CUDA for its all-reduce
    with the first stage's."""
    with contextlib.nullcontext() if not tc.use_cpu_initialization else cuda_as_cpu():
        chunks = build_chunks(config, tc, vocab_size)
    initialise_weights(chunks, tc, config.training.seed, sharded_state_metadata(config))
    return chunks


def build_chunks(config: TrainConfig, tc: TransformerConfig, vocab_size: int
                 ) -> list[GPTModel]:
    """`build_model`'s chunks with Megatron's own initial values (or none: built under a meta
    device context with `tc.perform_initialization=False`, they hold shapes only, which is how
    the memory planner counts a rank's shard of a model of any size)."""
    moe = config.moe_config()
    overrides = {layer: config.moe_config(layer) for layer in config.moe.layer_overrides}
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    virtual = config.parallel.virtual_stages
    chunks = []
    for vp_stage in range(virtual) if virtual > 1 else [None]:
        spec = gpt_decoder_block_spec(tc, moe, layer_overrides=overrides,
                                      vp_stage=vp_stage, pp_rank=pp_rank, step_owner=STEP_OWNER)
        chunks.append(GPTModel(
            mtp_block_spec=mtp_block_spec(tc, moe, overrides, vp_stage, pp_rank, STEP_OWNER),
            config=tc,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(vocab_size, config),
            max_sequence_length=config.model.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            share_embeddings_and_output_weights=config.model.share_embeddings,
            position_embedding_type=position_embedding_type(config),
            rotary_base=config.model.rotary_base,
            rotary_percent=config.model.rotary_percent,
            rope_scaling=config.model.rope_scaling_factor is not None,
            rope_scaling_factor=config.model.rope_scaling_factor or 8.0,
            vp_stage=vp_stage,
        ))
    return chunks
