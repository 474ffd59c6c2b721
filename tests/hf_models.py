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
    # Attention sinks and biases, layers alternating a sliding window of 8 (shorter than the
    # tests' sequences) and full attention, YaRN untruncated as the release sets it (context
    # x4 here), router and expert biases, the clamped SwiGLU with a limit the tiny random
    # activations reach (the release: 7.0).
    "gpt_oss": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False},
                    rms_norm_eps=1e-5, head_dim=16, intermediate_size=32, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0),
    # Heads wider than hidden / heads, half of each rotated, q/k/v biases, per-head QK norm, 8
    # experts in 2 groups (1 per token), a dense first layer, 1 shared expert, gates scaled by
    # 2.5, a non-zero correction bias; MTP announced (transformers' default) but not saved.
    "glm4_moe": dict(rope_theta=1000000.0, rms_norm_eps=1e-5, head_dim=32,
                     partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                     n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5),
    # Every layer MoE, QK norm over the whole projections, a quarter of each head rotated
    # (rotary_dim), a non-zero correction bias.
    "minimax_m2": dict(rope_theta=5000000.0, rms_norm_eps=1e-6, head_dim=32, rotary_dim=8,
                       intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "minimax_m2",
             "gpt_oss")
# Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json) is DeepSeek-V3's architecture with its own
# structural settings: 384 routed experts, 8 chosen, all in one group (n_group = topk_group = 1),
# gates scaled by 2.827, one dense first layer, one shared expert, YaRN x32 with beta_fast =
# beta_slow = 1 and rope_theta 50000; widths tiny (the release: hidden 7168, 64 heads).
# save_tiny_hf_model("deepseek_v3", folder, **KIMI_K2).
KIMI_K2 = dict(rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                "original_max_position_embeddings": 64, "beta_fast": 1.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
               max_position_embeddings=2048, n_routed_experts=384, num_experts_per_tok=8,
               n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
               n_shared_experts=1, moe_intermediate_size=8)
TOKENIZERS = {"qwen2_moe": "save_qwen_like", "qwen3_moe": "save_qwen_like",
              "qwen2": "save_qwen_like", "qwen3": "save_qwen_like",
              "deepseek_v3": "save_deepseek_like", "glm4_moe": "save_qwen_like",
              "minimax_m2": "save_qwen_like", "gpt_oss": "save_qwen_like"}
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


def add_mtp_tensors(directory: Path, seed: int = 1) -> Path:
    """Give the saved model in `directory` (DeepSeek-V3 or GLM-4.5, N decoder layers) one
    multi-token-prediction layer as their releases store it, which transformers' models neither
    build nor save: `model.layers.{N}.` holds a decoder layer shaped like layer N-1 (random),
    `enorm`, `hnorm`, `eh_proj` [H, 2H], `shared_head.norm` (random) and copies of the main
    embedding (`embed_tokens`) and output head (`shared_head.head`); written as a shard of its own
    and listed in the index, and config.json's `num_nextn_predict_layers` set to 1."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    config = json.loads((directory / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]

    def read(name: str) -> torch.Tensor:
        with safe_open(str(directory / index["weight_map"][name]), "pt") as f:
            return f.get_tensor(name)

    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n - 1}."
    mtp = {}
    for name in sorted(index["weight_map"]):
        if name.startswith(last):
            like = read(name)
            values = (torch.randn(like.shape, generator=gen) * 0.1 if like.dim() > 1 or
                      name.endswith("e_score_correction_bias") else
                      torch.rand(like.shape, generator=gen) + 0.5)
            mtp[f"model.layers.{n}." + name[len(last):]] = values.to(like.dtype)
    dtype = read("model.embed_tokens.weight").dtype
    for part, shape in [("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("shared_head.norm.weight", (hidden,))]:
        mtp[f"model.layers.{n}.{part}"] = (torch.rand(shape, generator=gen) + 0.5).to(dtype)
    mtp[f"model.layers.{n}.eh_proj.weight"] = \
        (torch.randn((hidden, 2 * hidden), generator=gen) * 0.1).to(dtype)
    mtp[f"model.layers.{n}.embed_tokens.weight"] = read("model.embed_tokens.weight")
    mtp[f"model.layers.{n}.shared_head.head.weight"] = read("lm_head.weight")
    save_file(mtp, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({name: "model-mtp.safetensors" for name in mtp})
    index_path.write_text(json.dumps(index, indent=2))
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory's safetensors files, read by safetensors
    itself."""
    from safetensors.torch import load_file

    return {name: tensor for path in sorted(directory.glob("*.safetensors"))
            for name, tensor in load_file(str(path)).items()}


def saved_config(directory: Path) -> dict:
    """config.json of a model directory without the keys saving adds (dtype, source path)."""
    import json

    config = json.loads((directory / "config.json").read_text())
    return {key: value for key, value in config.items()
            if key not in ("dtype", "torch_dtype", "_name_or_path")}
