"""Logits of a Hugging Face model (transformers, fp32) against a megamoe checkpoint's, both on
the GPU where there is one, else on the CPU (`megamoe.upcycle.verify.compute_device`).

The megamoe side is the training model itself: `megamoe.train.model.build_model` from the
checkpoint's `model`/`moe` config sections (Megatron-Core GPTModel with megamoe MoE layers),
loaded through `megamoe.train.checkpoint.load_model_weights`, at world size 1. So a
passing check also proves that `python -m megamoe.train ... checkpoint.init_from=CKPT` starts
from these weights. The Hugging Face side is `AutoModelForCausalLM.from_pretrained` with eager
attention: the architecture's own reference code.
"""
from __future__ import annotations

from pathlib import Path

import torch

SEQUENCES, SEQ_LEN = 4, 32


def sample_tokens(vocab_size: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (SEQUENCES, seq_len), generator=generator)


def load_hf_model(directory: Path):
    """transformers' model of the Hugging Face model in `directory` (fp32, eager attention), on
    the compute device. A model_type transformers has no class for, which megamoe's table reads
    as another architecture (Kimi-K2's `kimi_k2`: DeepseekV3ForCausalLM, as its config.json's
    `architectures` says), is built with that architecture's class."""
    from transformers import AutoModelForCausalLM

    from megamoe.upcycle.verify import compute_device

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                attn_implementation="eager",
                                                **_foreign_config(Path(directory))).to(
                                                    compute_device()).eval()


def _foreign_config(directory: Path) -> dict:
    """{"config": ...} for a model_type transformers lacks (see load_hf_model), else {}."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from megamoe.checkpointing.hf import architecture
    from megamoe.checkpointing.hf_arch import CONFIG_FILE, read_config_json

    config = read_config_json(directory)
    if config.get("model_type") in CONFIG_MAPPING:
        return {}
    model_class = getattr(transformers, architecture(config, directory / CONFIG_FILE).hf_class)
    fields = {key: value for key, value in config.items() if key not in ("model_type", "auto_map")}
    return {"config": model_class.config_class.from_dict(fields)}


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, S, V], on the CPU, of a transformers model for `tokens`."""
    with torch.no_grad():
        return model(tokens.to(model.device)).logits.float().cpu()


def megamoe_logits(checkpoint_dir: Path, sections: dict, tokens: torch.Tensor,
                   expert_parallel: int = 1) -> torch.Tensor:
    """Logits [B, S, V] of the megamoe model that `sections` builds, with the weights of the
    torch_dist checkpoint at `checkpoint_dir`; its experts split over `expert_parallel` ranks
    (every rank of the world computes the same batch)."""
    from megatron.core import parallel_state

    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.train.checkpoint import load_model_weights
    from megamoe.train.config import config_from_dict
    from megamoe.train.model import build_model, transformer_config
    from megamoe.upcycle.verify import compute_device, gpt_logits

    # Without multi-token prediction: its layers change no logit (DeepSeek-V3, sec. 2.2: dropped
    # at inference), and Megatron-Core's GPTModel computes their loss on every forward, which
    # needs labels; the checkpoint's MTP tensors are left unread.
    model_section = {**sections["model"], "mtp_layers": 0,
                     "seq_length": max(tokens.shape[1], sections["model"].get("seq_length", 1))}
    config = config_from_dict({"model": model_section, "moe": sections["moe"],
                               "parallel": {"expert": expert_parallel}})
    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        setup_megatron(expert_model_parallel_size=expert_parallel)
    try:
        (model,) = build_model(config, transformer_config(config, on_cuda=False, bf16=False),
                               vocab_size=sections["vocab_size"])
        load_model_weights(checkpoint_dir, model.to(compute_device()), config)
        return gpt_logits(model.eval(), tokens)
    finally:
        if own_state:
            teardown_megatron()


def hf_vs_megamoe(hf_dir: Path, checkpoint_dir: Path, sections: dict, weights=None) -> float:
    """max |HF logits - megamoe logits| over SEQUENCES random sequences of SEQ_LEN tokens.
    `weights`: the import's WeightsReader (megamoe.checkpointing.quantized), whose tensors
    transformers then runs on (a quantised release dequantised, or cast to the import's dtype)."""
    from megamoe.checkpointing.quantized import unquantized_model

    with unquantized_model(Path(hf_dir), weights) as directory:
        hf = load_hf_model(directory)
    tokens = sample_tokens(hf.config.vocab_size)
    reference = hf_logits(hf, tokens)
    del hf
    ours = megamoe_logits(checkpoint_dir, {**sections, "vocab_size": reference.shape[-1]}, tokens)
    return float((reference - ours[..., :reference.shape[-1]]).abs().max())


def require_within(diff: float, tolerance: float, what: str) -> None:
    """Fail a `--verify` whose max |difference| exceeds the bar (the caller's atomic output
    directory is then removed)."""
    from megamoe.errors import CheckpointError

    if not diff <= tolerance:
        raise CheckpointError(f"verification failed: max |{what} diff| {diff:.3e} exceeds "
                              f"{tolerance:.0e}; no output was written")
