"""Compare a dense checkpoint's logits with its upcycled MoE checkpoint's, in fp32 (on the
GPU where there is one, else on the CPU).

The dense model is a Megatron-Core GPTModel (local spec). A torch_dist source is loaded by
Megatron's own `dist_checkpointing.load` (with megamoe's restricted unpicklers); a legacy source from the upcycler's merged global
tensors. The MoE model is Megatron-Core's own MoE GPTModel (local spec, SequentialMLP, the
`megatron_settings` the recipe recorded), loaded with `dist_checkpointing.load` from the output,
so the check also proves Megatron-Core reads the output layout. Runs at world size 1.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megamoe.checkpointing.legacy_source import MODULE_TO_SHARDED
from megamoe.checkpointing.sharded_keys import LAYER_PREFIX
from megamoe.checkpointing.source import DenseSource
from megamoe.errors import ConfigError
from megamoe.upcycle.arch import DenseArch, dense_arch

SEQUENCES, SEQ_LEN = 4, 32
CPU_SETTINGS = dict(add_bias_linear=False, use_cpu_initialization=True,
                    params_dtype=torch.float32, bf16=False, fp16=False, hidden_dropout=0.0,
                    attention_dropout=0.0)
MOE_SETTINGS = dict(moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall",
                    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def sharded_metadata(key_layout: str) -> dict:
    """`sharded_state_dict` metadata that makes Megatron use `key_layout`'s keys."""
    if key_layout == "singleton":
        return {"singleton_local_shards": True}
    if key_layout == "per_layer":
        return {"non_homogeneous_layers": True}
    return {}


def build_reference_gpt(arch: DenseArch, moe_settings: dict | None):
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(**{**CPU_SETTINGS, **arch.config, **(moe_settings or {})})
    if moe_settings and moe_settings["moe_layer_freq"] != 1:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=arch.normalization)
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=moe_settings["num_moe_experts"] if moe_settings else None,
            moe_grouped_gemm=False, qk_layernorm=arch.qk_layernorm,
            normalization=arch.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec, pre_process=True,
                    post_process=True, **arch.gpt).to(compute_device()).eval()


def load_dist_weights(model, directory: Path, key_layout: str) -> None:
    from megamoe.checkpointing.safe_dcp import load_dist_checkpoint

    request = model.sharded_state_dict(metadata=sharded_metadata(key_layout))
    state = load_dist_checkpoint(request, directory)
    # the result also holds the checkpoint's common state (iteration, args, ...)
    model.load_state_dict({key: state[key] for key in request})


def _load_merged(model, source: DenseSource) -> None:
    """Load a legacy source's merged tensors by module key (global layer indices)."""
    module_keys = set(model.state_dict())
    state = {}
    for index in range(source.num_layers):
        for suffix, tensor in source.layer(index).tensors.items():
            state[_module_key(f"{LAYER_PREFIX}{index}.", suffix, module_keys)] = tensor
    state.update(source.non_layer_tensors())
    model.load_state_dict(state, strict=False)
    missing = sorted(key for key in module_keys - set(state) if not key.endswith("_extra_state"))
    if missing:
        raise ConfigError(f"verify: the dense model expects {missing[:4]}, which the checkpoint "
                          "lacks; check --arch")


def _module_key(prefix: str, suffix: str, module_keys: set[str]) -> str:
    if prefix + suffix in module_keys:
        return prefix + suffix
    for module, sharded in MODULE_TO_SHARDED:
        if suffix.startswith(sharded) and prefix + module + suffix[len(sharded):] in module_keys:
            return prefix + module + suffix[len(sharded):]
    return prefix + suffix


def compute_device() -> torch.device:
    """Where a verification runs its models: the current CUDA device where there is one
    (Megatron-Core's modules allocate their buffers there), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def gpt_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, S, V], on the CPU, of a GPTModel for `tokens` at positions 0..S-1, run
    on the device of the model's weights with that device's causal mask."""
    from megamoe.megatron.masks import attention_mask_for

    device = next(model.parameters()).device
    tokens = tokens.to(device)
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=device).expand_as(tokens)
    mask = attention_mask_for(seq, on_cuda=device.type == "cuda")
    with torch.no_grad():
        return model(tokens, positions, mask).float().cpu()


def max_logit_difference(source: DenseSource, checkpoint_dir: Path, record: dict,
                         overrides: dict[str, Any]) -> float:
    """max |dense logits - MoE logits| over SEQUENCES random sequences of SEQ_LEN tokens."""
    from megatron.core import parallel_state

    from megamoe.megatron.runtime import setup_megatron, teardown_megatron

    if record["recipe"]["target_spec"] != "local":
        raise ConfigError("--verify builds Megatron's local-spec models; it cannot check a "
                          "--target-spec te checkpoint (load it in a Transformer Engine run)")
    arch = dense_arch(source, record, overrides)
    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        setup_megatron()
    try:
        dense = build_reference_gpt(arch, None)
        if source.format == "torch_dist":
            load_dist_weights(dense, source.reader.directory, source.key_layout)
        else:
            _load_merged(dense, source)
        moe = build_reference_gpt(arch, {**MOE_SETTINGS, **record["megatron_settings"]})
        load_dist_weights(moe, checkpoint_dir, record["key_layout"])
        seq = min(SEQ_LEN, arch.gpt["max_sequence_length"])
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, arch.gpt["vocab_size"], (SEQUENCES, seq), generator=generator)
        return float((gpt_logits(dense, tokens) - gpt_logits(moe, tokens)).abs().max())
    finally:
        if own_state:
            teardown_megatron()
