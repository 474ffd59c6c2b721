"""Tiny random Hugging Face models of each architecture megamoe converts (dense and MoE), saved
with safetensors (sharded when asked), for the interop tests."""
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
    "mixtral": dict(rope_theta=1000000.0, rms_norm_eps=1e-5, intermediate_size=64,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    # Layer 0 dense (mlp_only_layers), gates not renormalised, gated shared expert, QKV biases.
    "qwen2_moe": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[0],
                      norm_topk_prob=False, tie_word_embeddings=True),
    "qwen3_moe": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, head_dim=32, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    # MLA with a q rank and YaRN as DeepSeek-V3 sets it (context x4, softmax rescaled), 8
    # experts in 2 groups (1 per token), a dense first layer, 1 shared expert, gates scaled by
    # 2.5, a non-zero correction bias (set below).
    "deepseek_v3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                         "factor": 4.0, "original_max_position_embeddings": 64,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                         "mscale_all_dim": 1.0},
                        rms_norm_eps=1e-6, num_key_value_heads=4,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
TOKENIZERS = {"qwen2_moe": "save_qwen_like", "qwen3_moe": "save_qwen_like",
              "qwen2": "save_qwen_like", "qwen3": "save_qwen_like",
              "deepseek_v3": "save_deepseek_like"}
"""The tokenizer each released model ships (tests/tiny_tokenizers.py); the others: Mixtral's."""


def save_tiny_tokenizer(arch: str, directory: Path) -> dict:
    """Write the tokenizer files a released `arch` model ships into `directory`; returns the
    ids that go with them in its config.json, as transformers' AutoTokenizer reads them."""
    import tiny_tokenizers
    from transformers import AutoTokenizer

    getattr(tiny_tokenizers, TOKENIZERS.get(arch, "save_mixtral_like"))(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return {key: getattr(tokenizer, key) for key in ("bos_token_id", "eos_token_id",
                                                     "pad_token_id")}


def save_tiny_hf_model(arch: str, directory: Path, shard_size: str | None = "100KB",
                       seed: int = 0, tokenizer: bool = False, **overrides) -> Path:
    """A random `arch` model (weights std 0.1, so logits are not flat; DeepSeek-V3's correction
    biases N(0, 0.1), so they change the routing) saved to `directory`; with `tokenizer`, the
    tokenizer files the released model ships (`save_tiny_tokenizer`) and its ids in the
    configs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = save_tiny_tokenizer(arch, directory) if tokenizer else {}
    config = AutoConfig.for_model(arch, **{**BASE, **ARCHS[arch], **ids, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.1)
            else:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return directory
