"""Tiny random Hugging Face dense models of each architecture megamoe converts, saved with
safetensors (sharded when asked), for the interop tests."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 4096
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False)
ARCHS = {
    "llama": dict(rope_theta=500000.0, rms_norm_eps=1e-5,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
    "mistral": dict(rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=4096),
    "qwen2": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, head_dim=32),
}


def save_tiny_hf_model(arch: str, directory: Path, shard_size: str | None = "100KB",
                       seed: int = 0, **overrides) -> Path:
    """A random `arch` model (weights std 0.1, so logits are not flat) saved to `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **{**BASE, **ARCHS[arch], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.1)
            else:
                param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return directory
