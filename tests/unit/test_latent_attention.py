"""Multi-head latent attention as the trainer builds it (Megatron-Core's MLASelfAttention with
megamoe's core attention, on CPU) against MLA restated in plain torch from DeepSeek-V2 (arXiv
2405.04434, sec. 2.1): low-rank query and key-value latents with RMSNorm, RoPE on
a decoupled part of each head (the key part shared by all heads) rotating interleaved channel
pairs as DeepSeek's complex-number form does, softmax scale 1/sqrt(qk_head_dim +
qk_pos_emb_head_dim), causal; with YaRN (arXiv 2309.00071) as DeepSeek-V2 configures it."""
import math

import pytest
import torch

from megamoe.megatron.masks import causal_attention_mask
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.train.config import config_from_dict
from megamoe.train.model import build_model, transformer_config

S, B, H, HEADS = 12, 2, 32, 4
LATENT = dict(kv_lora_rank=8, qk_head_dim=8, v_head_dim=6)
YARN = dict(factor=4.0, original_max_position_embeddings=32, beta_fast=4.0, beta_slow=0.5,
            mscale=1.0, mscale_all_dim=0.8)
CASES = {  # name: (model settings, rotary base)
    "query_latent": (dict(q_lora_rank=16, qk_pos_emb_head_dim=4), 10000),
    "no_query_latent": (dict(q_lora_rank=None, qk_pos_emb_head_dim=4), 10000),
    "yarn": (dict(q_lora_rank=16, qk_pos_emb_head_dim=8, yarn=YARN), 100),
}


@pytest.fixture
def megatron():
    setup_megatron(seed=5)
    yield
    teardown_megatron()


def latent_attention(settings: dict, base: int) -> torch.nn.Module:
    """The first layer's attention of a one-layer dense MLA model built by the trainer, its
    weights redrawn large enough that the scores are not all near zero."""
    config = config_from_dict({
        "model": {"num_layers": 1, "hidden_size": H, "num_attention_heads": HEADS,
                  "ffn_hidden_size": 16, "seq_length": S, "first_k_dense": 1,
                  "position_embedding": "rope", "rotary_base": base,
                  "multi_latent_attention": True, **LATENT, **settings},
        "moe": {"num_experts": 2, "ffn_hidden_size": 8}})
    (model,) = build_model(config, transformer_config(config, False, False), 64)
    attention = model.decoder.layers[0].self_attention
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in attention.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.3 * noise if "layernorm" in name else 0.3 * noise)
    return attention


def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def yarn_get_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_frequencies(dim: int, base: int, yarn: dict):
    """Per-pair inverse frequencies and the factor on cos and sin: RoPE's, or YaRN's blend of
    interpolated and original frequencies over a linear ramp between the correction dims."""
    original = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if not yarn:
        return original, 1.0
    factor, length = yarn["factor"], yarn["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3))
    keep = 1 - ramp.clamp(0, 1)  # 1: the original frequency, 0: interpolated by the factor
    blended = original / factor * (1 - keep) + original * keep
    return blended, (yarn_get_mscale(factor, yarn["mscale"])
                     / yarn_get_mscale(factor, yarn["mscale_all_dim"]))


def rope_interleaved(x, inv_freq, scale):
    """DeepSeek's RoPE: channel pairs (2j, 2j+1) as complex numbers rotated by position x
    frequency j. x: [S, B, heads, d]."""
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv_freq  # [S, d/2]
    rotation = torch.polar(torch.full_like(angles, scale), angles)[:, None, None, :]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def naive_mla(attention, x, settings: dict, base: int):
    """DeepSeek-V2's MLA from `attention`'s weights. x: [S, B, H] -> [S, B, H]."""
    w = {name: p.detach() for name, p in attention.named_parameters()}
    dn, dr, dv = LATENT["qk_head_dim"], settings["qk_pos_emb_head_dim"], LATENT["v_head_dim"]
    if settings["q_lora_rank"] is None:
        q = x @ w["linear_q_proj.weight"].T
    else:
        latent_q = rms_norm(x @ w["linear_q_down_proj.weight"].T, w["q_layernorm.weight"])
        q = latent_q @ w["linear_q_up_proj.weight"].T
    q = q.view(S, B, HEADS, dn + dr)
    latent_kv, k_rope = (x @ w["linear_kv_down_proj.weight"].T).split(
        [LATENT["kv_lora_rank"], dr], -1)
    kv = (rms_norm(latent_kv, w["kv_layernorm.weight"]) @ w["linear_kv_up_proj.weight"].T)
    k_content, v = kv.view(S, B, HEADS, dn + dv).split([dn, dv], -1)
    inv_freq, rope_scale = rotary_frequencies(dr, base, settings.get("yarn"))
    q_rope = rope_interleaved(q[..., dn:], inv_freq, rope_scale)
    k_rope = rope_interleaved(k_rope[:, :, None, :], inv_freq, rope_scale)
    yarn = settings.get("yarn")
    mscale = yarn_get_mscale(yarn["factor"], yarn["mscale_all_dim"]) if yarn else 1.0
    scores = (torch.einsum("sbhd,tbhd->bhst", q[..., :dn], k_content)
              + torch.einsum("sbhd,tbxd->bhst", q_rope, k_rope)) * mscale ** 2 / math.sqrt(dn + dr)
    scores = scores.masked_fill(causal_attention_mask(S)[0], float("-inf"))
    context = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(S, B, HEADS * dv)
    return context @ w["linear_proj.weight"].T


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_mla_is_deepseeks_attention(megatron, case):
    settings, base = CASES[case]
    attention = latent_attention(settings, base)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    output, bias = attention(x, causal_attention_mask(S))
    assert bias is None
    torch.testing.assert_close(output, naive_mla(attention, x, settings, base),
                               rtol=1e-5, atol=1e-5)
