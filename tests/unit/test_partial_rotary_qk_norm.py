"""The trainer's attention with `model.rotary_percent` (partial RoPE) and
`model.qk_layernorm_scope` against transformers' own attention modules on the same weights:
GLM-4.5's (`Glm4MoeAttention`: q/k/v biases, per-head QK norm, half of each head rotated) and
MiniMax-M2's (`MiniMaxM2Attention`: one RMSNorm over the whole query and key projections, a
quarter of each head rotated), both grouped-query with a head size other than width / heads;
bad values are one-line errors, and a checkpoint of the other QK norm scope does not fit."""
import re
from pathlib import Path

import pytest
import torch

from megamoe.errors import CheckpointError, ConfigError
from megamoe.megatron.masks import causal_attention_mask
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.train.config import config_from_dict
from megamoe.train.model import build_model, transformer_config

S, B, H, HEADS, GROUPS, HEAD = 10, 2, 32, 4, 2, 16
PATH = Path("ckpt/iter_0000002")
CASES = {  # name: (model settings, transformers model type, its config fields)
    "glm4_moe": (dict(rotary_percent=0.5, add_qkv_bias=True, qk_layernorm=True),
                 "glm4_moe", dict(partial_rotary_factor=0.5, attention_bias=True,
                                  use_qk_norm=True)),
    "minimax_m2": (dict(rotary_percent=0.25, qk_layernorm=True,
                        qk_layernorm_scope="projection"),
                   "minimax_m2", dict(rotary_dim=4)),
}


@pytest.fixture
def megatron():
    setup_megatron(seed=3)
    yield
    teardown_megatron()


def model_settings(**settings) -> dict:
    return {"model": {"num_layers": 1, "hidden_size": H, "num_attention_heads": HEADS,
                      "num_query_groups": GROUPS, "kv_channels": HEAD, "ffn_hidden_size": 16,
                      "seq_length": S, "first_k_dense": 1, "position_embedding": "rope",
                      "rotary_base": 500.0, "norm_epsilon": 1e-6, **settings},
            "moe": {"num_experts": 2, "ffn_hidden_size": 8}}


def megatron_model(settings: dict):
    """A one-layer dense model built by the trainer, its attention weights redrawn large
    enough that the scores are not all near zero."""
    config = config_from_dict(model_settings(**settings))
    (model,) = build_model(config, transformer_config(config, False, False), 64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.decoder.layers[0].self_attention.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.3 * noise if "layernorm" in name else 0.3 * noise)
    return model


def transformers_attention(model_type: str, fields: dict, attention):
    """transformers' attention of `model_type` holding `attention`'s weights, and its rotary
    embedding: Megatron's fused
    projection is, per query group, that group's query heads, then its key, then its value."""
    from transformers import AutoConfig
    from transformers.models.glm4_moe import modeling_glm4_moe as glm
    from transformers.models.minimax_m2 import modeling_minimax_m2 as minimax

    config = AutoConfig.for_model(model_type, hidden_size=H, num_attention_heads=HEADS,
                                  num_key_value_heads=GROUPS, head_dim=HEAD, rms_norm_eps=1e-6,
                                  rope_theta=500.0, **fields)
    config._attn_implementation = "eager"
    attention_kind, rotary_kind = (
        (glm.Glm4MoeAttention, glm.Glm4MoeRotaryEmbedding) if model_type == "glm4_moe" else
        (minimax.MiniMaxM2Attention, minimax.MiniMaxM2RotaryEmbedding))
    hf = attention_kind(config, layer_idx=0)
    w = dict(attention.named_parameters())
    per_group = [HEADS // GROUPS * HEAD, HEAD, HEAD]
    q, k, v = (part.reshape(-1, *part.shape[2:]) for part in
               w["linear_qkv.weight"].view(GROUPS, sum(per_group), H).split(per_group, 1))
    state = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
             "o_proj.weight": w["linear_proj.weight"], "q_norm.weight": w["q_layernorm.weight"],
             "k_norm.weight": w["k_layernorm.weight"]}
    if "linear_qkv.bias" in w:
        q, k, v = (part.reshape(-1) for part in
                   w["linear_qkv.bias"].view(GROUPS, sum(per_group)).split(per_group, 1))
        state.update({"q_proj.bias": q, "k_proj.bias": k, "v_proj.bias": v})
    hf.load_state_dict(state, strict=True)
    return hf, rotary_kind(config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_is_transformers(megatron, case):
    settings, model_type, fields = CASES[case]
    model = megatron_model(settings)
    attention = model.decoder.layers[0].self_attention
    hf, rope = transformers_attention(model_type, fields, attention)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = attention(x, causal_attention_mask(S), rotary_pos_emb=model.rotary_pos_emb(S))
        hidden = x.transpose(0, 1)
        cos_sin = rope(hidden, torch.arange(S)[None].expand(B, S))
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        theirs, _ = hf(hidden, position_embeddings=cos_sin, attention_mask=mask)
    torch.testing.assert_close(ours.transpose(0, 1), theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings, message", [
    (dict(rotary_percent=0.0), "model.rotary_percent=0.0 must be in (0, 1]"),
    (dict(rotary_percent=0.2), "model.rotary_percent=0.2 rotates 3 of the 16 channels"),
    (dict(rotary_percent=0.5, position_embedding="learned_absolute"),
     "needs model.position_embedding=rope"),
    (dict(qk_layernorm_scope="projection"), "needs model.qk_layernorm=true"),
    (dict(qk_layernorm_scope="heads"), "model.qk_layernorm_scope"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        config_from_dict(model_settings(**settings))
    assert "\n" not in str(error.value)


def test_a_checkpoint_fits_another_rotary_percent_but_not_another_qk_norm_scope(megatron):
    """Megatron-Core builds other norm tensors for the other scope (the load names the
    setting), the same tensors for another rotary fraction (the weights load)."""
    from megamoe.train.checkpoint_schema import FORMAT_VERSION
    from megamoe.train.checkpoint_shapes import check_weights_fit

    def shapes(config) -> dict:
        (model,) = build_model(config, transformer_config(config, False, False), 64)
        return {key: tuple(value.shape) for key, value in model.state_dict().items()
                if not key.endswith("_extra_state")}

    saved = config_from_dict(model_settings(qk_layernorm=True))
    common = {"format_version": FORMAT_VERSION, "layout": {"world_size": 1},
              "train_state": {"iteration": 2, "consumed_samples": 8},
              "config": saved.to_dict()}
    rotated = config_from_dict(model_settings(qk_layernorm=True, rotary_percent=0.5))
    assert shapes(rotated) == shapes(saved)
    check_weights_fit(common, rotated, PATH)
    projection = config_from_dict(model_settings(qk_layernorm=True,
                                                 qk_layernorm_scope="projection"))
    assert shapes(projection) != shapes(saved)
    with pytest.raises(CheckpointError, match="holds a model with model.qk_layernorm_scope="):
        check_weights_fit(common, projection, PATH)
