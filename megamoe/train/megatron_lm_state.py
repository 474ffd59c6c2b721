"""The common state Megatron-LM writes into a torch_dist checkpoint, and reading it back.

Megatron-LM's `megatron/training/checkpointing.py` (core_v0.16.1 and main): `generate_state_dict`
stores `args` (its argparse Namespace), `checkpoint_version` (3.0), `iteration`, the model's
sharded state dict under `model`, `optimizer`, `opt_param_scheduler` and `rng_state`; the save
adds `num_floating_point_operations_so_far`. `load_checkpoint` reads `args` through
`check_checkpoint_args` (num_layers, hidden_size, num_attention_heads, add_position_embedding,
...), takes `tensor/pipeline_model_parallel_size` from it to decide what to reshard, resumes
the sample count from `args.consumed_train_samples`, and requests RNG and optimizer state only
when `args.no_save_rng` / `args.no_save_optim` are false. megamoe's RNG and optimizer state are
not in Megatron-LM's layout, so the args say they were not saved: Megatron-LM's
`pretrain_gpt.py --load DIR --no-load-optim` continues from the model weights and the position.
The model fields `load_args_from_checkpoint` (--use-checkpoint-args) copies are present too.
"""
from __future__ import annotations

import argparse

import torch

from megamoe.checkpointing.layout import TrainState
from megamoe.errors import CheckpointError
from megamoe.train.config import TrainConfig
from megamoe.train.model import latent_attention_settings
from megamoe.train.schedule import LRSchedule

CHECKPOINT_VERSION = 3.0
# Model settings a resumed run must share with the checkpoint: (Megatron-LM arg, megamoe key).
_SHAPE_ARGS = (("num_layers", "num_layers"), ("hidden_size", "hidden_size"),
               ("num_attention_heads", "num_attention_heads"),
               ("ffn_hidden_size", "ffn_hidden_size"))


def megatron_lm_args(config: TrainConfig, state: TrainState, model: torch.nn.Module,
                     layout: dict) -> argparse.Namespace:
    """Megatron-LM's `args` for this run, with the fields its checkpoint loading reads."""
    m, moe = config.model, config.moe_config()
    dp = layout["world_size"] // (layout["tensor"] * layout["pipeline"])
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
        group_query_attention=m.num_query_groups not in (None, m.num_attention_heads),
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.seq_length, seq_length=m.seq_length,
        # Megatron-LM's own default (its examples pass --position-embedding-type rope without
        # --no-position-embedding), which check_checkpoint_args compares on --load; the
        # positions used are position_embedding_type's.
        add_position_embedding=True,
        position_embedding_type=m.position_embedding, rotary_base=m.rotary_base,
        use_rotary_position_embeddings=m.position_embedding == "rope",
        rotary_percent=m.rotary_percent,
        use_rope_scaling=m.rope_scaling_factor is not None,
        rope_scaling_factor=m.rope_scaling_factor or 8.0, norm_epsilon=m.norm_epsilon,
        normalization=m.normalization, swiglu=m.swiglu,
        qk_layernorm=m.qk_layernorm or m.multi_latent_attention,
        multi_latent_attention=m.multi_latent_attention,
        # MLA's sizes and RoPE (YaRN) settings, under MLATransformerConfig's names, which
        # Megatron-LM's flags (--q-lora-rank, --rope-type, --rotary-scaling-factor, ...) take.
        **{k: v for k, v in latent_attention_settings(config).items() if k != "rotary_base"},
        add_bias_linear=False, add_qkv_bias=m.add_qkv_bias, apply_query_key_layer_scaling=False,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        spec=["megamoe.megatron.specs", "decoder_block_spec"], moe_layer_freq=m.moe_layer_freq,
        untie_embeddings_and_output_weights=not m.share_embeddings,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        padded_vocab_size=getattr(model[0] if isinstance(model, torch.nn.ModuleList) else model,
                                  "vocab_size", None),
        num_experts=moe.num_experts, moe_router_topk=moe.topk,
        moe_router_score_function=moe.router.score_function,
        moe_router_topk_scaling_factor=moe.router.topk_scaling_factor,
        moe_shared_expert_intermediate_size=moe.shared_expert.ffn_hidden_size,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        tensor_model_parallel_size=layout["tensor"],
        pipeline_model_parallel_size=layout["pipeline"],
        virtual_pipeline_model_parallel_size=layout.get("virtual") if layout.get("virtual", 1) > 1
        else None,
        expert_model_parallel_size=layout["expert"], world_size=layout["world_size"],
        data_parallel_size=dp, micro_batch_size=config.training.micro_batch_size,
        global_batch_size=config.training.global_batch_size,
        train_iters=config.training.train_steps, iteration=state.iteration,
        consumed_train_samples=state.consumed_samples, skipped_train_samples=0,
        consumed_valid_samples=0, seed=config.training.seed, lr=config.optimizer.lr,
        min_lr=config.optimizer.min_lr, ckpt_format="torch_dist", use_dist_ckpt=True,
        no_save_rng=True, no_save_optim=True)


def opt_param_scheduler_state(schedule: LRSchedule, iteration: int,
                              config: TrainConfig) -> dict:
    """The keys of Megatron-Core's `OptimizerParamScheduler.state_dict()` for megamoe's schedule
    (steps counted in iterations, as Megatron-LM does with --train-iters)."""
    return {"max_lr": schedule.lr, "min_lr": schedule.min_lr,
            "lr_warmup_steps": schedule.warmup_steps,
            "lr_decay_steps": schedule.warmup_steps + schedule.decay_steps,
            "lr_decay_style": schedule.style, "num_steps": iteration,
            "start_wd": config.optimizer.weight_decay, "end_wd": config.optimizer.weight_decay,
            "wd_incr_style": "constant", "wd_incr_steps": 0}


def megatron_lm_common(config: TrainConfig, state: TrainState, model: torch.nn.Module,
                       layout: dict, schedule: LRSchedule) -> dict:
    """Megatron-LM's common checkpoint keys (see the module docstring)."""
    return {"args": megatron_lm_args(config, state, model, layout),
            "checkpoint_version": CHECKPOINT_VERSION, "iteration": state.iteration,
            "opt_param_scheduler": opt_param_scheduler_state(schedule, state.iteration, config),
            "num_floating_point_operations_so_far": 0}


def is_megatron_lm_checkpoint(common: dict) -> bool:
    """Whether a common state has what Megatron-LM's `generate_state_dict` always writes: its
    argparse `args`, a numeric `checkpoint_version` and the `iteration`."""
    version = common.get("checkpoint_version")
    return (isinstance(common.get("args"), argparse.Namespace) and "iteration" in common
            and isinstance(version, (int, float)) and not isinstance(version, bool))


def check_megatron_lm_args(common: dict, config: TrainConfig, path) -> None:
    """Refuse a Megatron-LM checkpoint of another model shape (check_checkpoint_args' fields)."""
    args = common["args"]
    for arg, key in _SHAPE_ARGS:
        saved, wanted = getattr(args, arg, None), getattr(config.model, key)
        if saved is not None and saved != wanted:
            raise CheckpointError(f"checkpoint {path} has {arg}={saved!r} but the config says "
                                  f"model.{key}={wanted!r}; use the checkpoint's model settings")
    moe = config.moe_config()
    for arg, key in (("num_experts", "num_experts"), ("moe_ffn_hidden_size", "ffn_hidden_size")):
        saved, wanted = getattr(args, arg, None), getattr(moe, key)
        if saved is not None and saved != wanted:
            raise CheckpointError(f"checkpoint {path} has {arg}={saved!r} but the config says "
                                  f"moe.{key}={wanted!r}; use the checkpoint's model settings")


def train_state_of(common: dict) -> TrainState:
    """The run's position in a Megatron-LM checkpoint (iteration, args.consumed_train_samples)."""
    iteration = common["iteration"]
    consumed = getattr(common["args"], "consumed_train_samples", 0)
    if type(iteration) is not int or type(consumed) is not int or iteration < 0 or consumed < 0:
        raise CheckpointError(f"iteration {iteration!r} / consumed_train_samples {consumed!r} "
                              "of the checkpoint are not counts; the checkpoint is corrupt")
    return TrainState(iteration, consumed)
