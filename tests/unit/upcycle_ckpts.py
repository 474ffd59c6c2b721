"""Dense and MoE Megatron-Core GPT models and checkpoints for the upcycling tests.

Dense checkpoints are made by Megatron-Core itself (`dist_checkpointing.save` for torch_dist, a
module `state_dict()` per rank for the legacy layout), with Megatron-LM's metadata (`args`,
iteration, RNG state) around them. MoE reference models are Megatron-Core's own MoE GPTModel
(local spec, SequentialMLP), built here independently of megamoe.upcycle.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec)
from megatron.core.transformer.enums import AttnBackend

from tiny_models import build_gpt, tiny_transformer_config
from megamoe.megatron.masks import causal_attention_mask

VOCAB, SEQ, HEADS = 128, 16, 4
GLU = dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
           qk_layernorm=True)
PLAIN = dict(gated_linear_unit=False, activation_func=F.gelu, normalization="LayerNorm",
             qk_layernorm=False)
MOE_DEFAULTS = dict(moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall",
                    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def config(style: dict, **changes):
    return tiny_transformer_config(num_attention_heads=HEADS, **{**style, **changes})


def layer_spec(cfg):
    """Megatron's local GPT spec for `cfg` (its MoE block spec for mixed dense/MoE layers)."""
    if cfg.num_moe_experts and cfg.moe_layer_freq != 1:
        return get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                          normalization=cfg.normalization)
    return get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization)


def build(cfg):
    return build_gpt(cfg, layer_spec(cfg), vocab_size=VOCAB, seq_len=SEQ).eval()


def moe_config(style: dict, num_layers: int, settings: dict, **changes):
    """A Megatron MoE config with the `moe_*` settings an upcycling recipe recorded."""
    return config(style, num_layers=num_layers, **{**MOE_DEFAULTS, **settings, **changes})


def megatron_lm_args(cfg) -> argparse.Namespace:
    """The part of Megatron-LM's saved `args` the upcycler reads, plus an enum and sizes."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=False,
        num_query_groups=None, kv_channels=None, swiglu=cfg.gated_linear_unit,
        squared_relu=False, normalization=cfg.normalization, norm_epsilon=cfg.layernorm_epsilon,
        max_position_embeddings=SEQ, tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto)


def save_torch_dist(model, directory: Path, args: argparse.Namespace, iteration: int = 7,
                    metadata: dict | None = None) -> Path:
    """Megatron-LM's torch_dist layout: ROOT/latest_checkpointed_iteration.txt + iter_*/."""
    ckpt = directory / f"iter_{iteration:07d}"
    if torch.distributed.get_rank() == 0:
        ckpt.mkdir(parents=True)
        (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": args,
             "iteration": iteration, "checkpoint_version": 3.0}
    dist_checkpointing.save(state, str(ckpt))
    return directory


def save_legacy(model, directory: Path, args: argparse.Namespace, iteration: int = 7) -> Path:
    """Megatron-LM's legacy layout: one model_optim_rng.pt per (TP, PP) rank."""
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    name = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    rank_dir = directory / f"iter_{iteration:07d}" / name
    rank_dir.mkdir(parents=True, exist_ok=True)
    (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    rng_state = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                  "torch_rng_state": torch.get_rng_state()}]
    torch.save({"model": model.state_dict(), "args": args, "iteration": iteration,
                "checkpoint_version": 3.0, "rng_state": rng_state},
               rank_dir / "model_optim_rng.pt")
    return directory


def load_dist(model, directory: Path, metadata: dict | None = None):
    """Load a torch_dist checkpoint with Megatron's own loader."""
    request = model.sharded_state_dict(metadata=metadata)
    state = dist_checkpointing.load(request, str(directory))
    model.load_state_dict({key: state[key] for key in request})
    return model


def tokens(seed: int = 0, batch: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions, causal_attention_mask(ids.shape[1]))
