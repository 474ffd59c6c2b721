"""GPT-OSS's attention as the trainer builds it (Megatron-Core's attention with megamoe's
`SinkDotProductAttention` on CPU: per-head sinks, sliding windows on alternate layers, q/k/v/o
biases, YaRN for grouped-query attention with `truncate: false`) against transformers'
`GptOssAttention`, `GptOssRotaryEmbedding` and its masks on the same weights; YaRN's frequencies
and attention factor against transformers' `_compute_yarn_parameters`; Megatron's own
Transformer Engine attention against megamoe's where Transformer Engine is installed."""
import pytest
import torch
from transformers import GptOssConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

from megamoe.megatron.masks import causal_attention_mask
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.megatron.specs import transformer_engine_available
from megamoe.train.config import config_from_dict
from megamoe.train.model import build_model, transformer_config

S, B, H, HEADS, GROUPS, HEAD_DIM = 12, 2, 24, 4, 2, 16  # heads x head_dim != hidden, as GPT-OSS
THETA = 150000.0
GPT_OSS_YARN = dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                    beta_slow=1.0, truncate=False)
FAR = 4000  # positions FAR.. FAR+S-1: where YaRN's interpolated frequencies matter
CASES = {  # name: megamoe model settings
    "gpt_oss": dict(yarn=GPT_OSS_YARN, sliding_window=3, sliding_window_layers=[1, 0]),
    "every_layer_slides_no_yarn": dict(sliding_window=5),
}


@pytest.fixture
def megatron():
    setup_megatron(seed=5)
    yield
    teardown_megatron()


def trainer_model(settings: dict):
    """A two-layer GPT-OSS-like model built by the trainer (dense MLPs: only attention is
    compared here), its attention weights redrawn large enough to give peaked softmaxes."""
    config = config_from_dict({
        "model": {"num_layers": 2, "hidden_size": H, "num_attention_heads": HEADS,
                  "num_query_groups": GROUPS, "kv_channels": HEAD_DIM, "ffn_hidden_size": 16,
                  "seq_length": S, "first_k_dense": 2, "position_embedding": "rope",
                  "rotary_base": THETA, "add_qkv_bias": True, "add_bias_linear": True,
                  "attention_sinks": True, **settings},
        "moe": {"num_experts": 2, "ffn_hidden_size": 8}})
    tc = transformer_config(config, False, False)
    (model,) = build_model(config, tc, 64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "self_attention" in name:
                param.copy_(torch.randn(param.shape, generator=generator)
                            * (2.0 if "softmax_offset" in name else 0.5))
    return model, tc


def hf_config(settings: dict) -> GptOssConfig:
    """transformers' GPT-OSS config of the same attention."""
    yarn = settings.get("yarn")
    rope = ({"rope_type": "yarn", "rope_theta": THETA, **yarn} if yarn else
            {"rope_type": "default", "rope_theta": THETA})
    layers = settings.get("sliding_window_layers") or [1, 1]
    config = GptOssConfig(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
        head_dim=HEAD_DIM, num_hidden_layers=2, vocab_size=64, intermediate_size=8,
        num_local_experts=2, num_experts_per_tok=1, sliding_window=settings["sliding_window"],
        layer_types=["sliding_attention" if flag else "full_attention" for flag in layers],
        rope_parameters=rope)
    config._attn_implementation = "eager"
    return config


def load_hf_attention(reference: GptOssAttention, attention) -> None:
    """transformers' q/k/v/o (weights, biases) and sinks from Megatron's attention, whose fused
    QKV projection holds per key-value group [its query heads; key; value]."""
    per_group = HEADS // GROUPS + 2
    weight = attention.linear_qkv.weight.detach().view(GROUPS, per_group, HEAD_DIM, H)
    bias = attention.linear_qkv.bias.detach().view(GROUPS, per_group, HEAD_DIM)
    parts = {"q_proj": slice(0, per_group - 2), "k_proj": slice(per_group - 2, per_group - 1),
             "v_proj": slice(per_group - 1, per_group)}
    with torch.no_grad():
        for name, rows in parts.items():
            getattr(reference, name).weight.copy_(weight[:, rows].reshape(-1, H))
            getattr(reference, name).bias.copy_(bias[:, rows].reshape(-1))
        reference.o_proj.weight.copy_(attention.linear_proj.weight)
        reference.o_proj.bias.copy_(attention.linear_proj.bias)
        reference.sinks.copy_(attention.core_attention.softmax_offset)


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_is_transformers_gpt_oss(megatron, case):
    settings = CASES[case]
    model, _ = trainer_model(settings)
    config = hf_config(settings)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    batch_first = x.transpose(0, 1)
    positions = torch.arange(FAR, FAR + S).expand(B, S)
    cos_sin = GptOssRotaryEmbedding(config)(batch_first, positions)
    masks = {"sliding_attention": create_sliding_window_causal_mask(config, batch_first, None,
                                                                    None),
             "full_attention": create_causal_mask(config, batch_first, None, None)}
    rotary = model.rotary_pos_emb(FAR + S)
    rotary = (rotary[0] if isinstance(rotary, tuple) else rotary)[FAR:]  # YaRN's: (emb, mscale)
    for number, layer in enumerate(model.decoder.layers):
        attention = layer.self_attention
        output, bias = attention(x, causal_attention_mask(S), rotary_pos_emb=rotary)
        reference = GptOssAttention(config, number)
        load_hf_attention(reference, attention)
        expected, _ = reference(batch_first, cos_sin, masks[config.layer_types[number]])
        torch.testing.assert_close((output + bias).transpose(0, 1), expected,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_is_transformers_compute_yarn_parameters(megatron, truncate):
    """The trainer's YaRN inverse frequencies and cos/sin factor for grouped-query attention
    are transformers' (`truncate: false` keeps the correction range unrounded, which changes
    the frequencies: both settings are compared)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    yarn = {**GPT_OSS_YARN, "truncate": truncate}
    model, tc = trainer_model(dict(yarn=yarn, sliding_window=3))
    emb, _ = model.rotary_pos_emb(2)
    inv_freq = emb[1, 0, 0, :HEAD_DIM // 2]  # position 1: the frequencies themselves
    config = hf_config(dict(yarn=yarn, sliding_window=3))
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    other, _ = ROPE_INIT_FUNCTIONS["yarn"](hf_config(dict(
        yarn={**yarn, "truncate": not truncate}, sliding_window=3)))
    assert not torch.allclose(expected, other)  # the setting is seen by the comparison
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert _yarn_get_concentration_factor_from_config(tc) == pytest.approx(attention_factor,
                                                                           rel=1e-12)


@pytest.mark.skipif(not (torch.cuda.is_available() and transformer_engine_available()),
                    reason="needs CUDA and Transformer Engine")
def test_transformer_engine_attention_is_megamoes(megatron):
    """Megatron's Transformer Engine core attention (used when it is installed) gives megamoe's
    numbers for sinks and a sliding window."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megamoe.megatron.cpu import cpu_transformer_config
    from megamoe.megatron.sink_attention import SinkDotProductAttention, window_settings

    config = cpu_transformer_config(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, softmax_type="learnable", use_cpu_initialization=False,
        params_dtype=torch.bfloat16, bf16=True, **window_settings(5, None))
    mine = SinkDotProductAttention(config, 1, AttnMaskType.causal, "self").cuda()
    theirs = TEDotProductAttention(config, 1, AttnMaskType.causal, "self").cuda()
    with torch.no_grad():
        theirs.softmax_offset.copy_(torch.randn(4) * 2)
        mine.softmax_offset.copy_(theirs.softmax_offset)
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(32, 2, 4, 16, generator=generator).cuda().bfloat16()
    k, v = (torch.randn(32, 2, 2, 16, generator=generator).cuda().bfloat16() for _ in "kv")
    expected = mine(q, k, v, None, AttnMaskType.causal)
    torch.testing.assert_close(theirs(q, k, v, None, AttnMaskType.causal).float(),
                               expected.float(),
                               rtol=2e-2, atol=2e-2)
