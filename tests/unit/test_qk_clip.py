"""MuonClip's QK-clip (megamoe.train.qk_clip) against Kimi K2's rule restated by hand (arXiv
2507.20534, sec. 2.1): the per-head max logit recomputed from the layer's own projections with
loops over positions, the rescale as W_q, W_k *= sqrt(tau / S_max) for the heads above tau
(MLA: the RoPE query by tau / S_max, the shared RoPE key and the values untouched), and after
it the head's max logit on the same input is tau."""
import math

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megamoe.errors import ConfigError
from megamoe.megatron.masks import causal_attention_mask
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.train.qk_clip import QKClip
from test_latent_attention import CASES, latent_attention
from tiny_models import build_gpt, tiny_transformer_config

S, B, HIDDEN, HEADS, GROUPS = 6, 2, 32, 4, 2
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture
def megatron():
    setup_megatron(seed=3)
    yield
    teardown_megatron()


def grouped_attention():
    """One layer's attention (grouped-query, 4 heads over 2 key/value heads, no RoPE), weights
    large enough for logits of several units."""
    config = tiny_transformer_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                     num_query_groups=GROUPS, add_qkv_bias=True)
    model = build_gpt(config, get_gpt_layer_local_spec(), vocab_size=16, seq_len=S)
    attention = model.decoder.layers[0].self_attention
    with torch.no_grad():
        for param in (attention.linear_qkv.weight, attention.linear_qkv.bias):
            param.normal_(0, 0.5, generator=torch.Generator().manual_seed(param.dim()))
    return model, attention


def naive_max_logits(attention, x):
    """Per query head: max over batch and positions j <= i of q_i . k_j / sqrt(head_dim), with q
    and k from linear_qkv laid out per key/value group as [its query heads, key, value]."""
    qkv = x @ attention.linear_qkv.weight.detach().T + attention.linear_qkv.bias.detach()
    per_group = qkv.view(S, B, GROUPS, (HEADS // GROUPS + 2) * HEAD_DIM)
    maxima = []
    for head in range(HEADS):
        group, within = divmod(head, HEADS // GROUPS)
        q = per_group[:, :, group, within * HEAD_DIM:(within + 1) * HEAD_DIM]
        k = per_group[:, :, group, -2 * HEAD_DIM:-HEAD_DIM]
        maxima.append(max(float(q[i, b] @ k[j, b]) / math.sqrt(HEAD_DIM)
                          for b in range(B) for i in range(S) for j in range(i + 1)))
    return torch.tensor(maxima)


def step_logits(attention, clip, x):
    """One training forward of `attention` on x, then `clip.apply`: (the per-head max logits
    it recorded, the logged metrics)."""
    attention.train()
    attention(x, causal_attention_mask(S))
    recorded = attention.core_attention.current_max_attn_logits.clone()
    return recorded, clip.apply(optimizer=None)


def test_grouped_attention_clip_is_the_papers_rule(megatron):
    model, attention = grouped_attention()
    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(1))
    naive = naive_max_logits(attention, x)
    threshold = float(naive.sort().values[1])  # some heads above, some at or below
    clip = QKClip([model], threshold)
    before = {n: p.detach().clone() for n, p in attention.linear_qkv.named_parameters()}
    recorded, metrics = step_logits(attention, clip, x)
    torch.testing.assert_close(recorded, naive, rtol=1e-5, atol=1e-5)
    assert metrics == {"attention/layer1/max_logit": pytest.approx(float(naive.max()), 1e-5)}
    # The rule: each group's key and query heads by sqrt(tau / S_max of the group's worst head).
    gamma = (threshold / naive).clamp(max=1).view(GROUPS, -1).min(1).values
    assert (gamma < 1).any()
    for name, old in before.items():
        rows = old.view(GROUPS, (HEADS // GROUPS + 2) * HEAD_DIM, *old.shape[1:])
        expected = rows.clone()
        expected[:, :-HEAD_DIM] *= gamma.sqrt().view(GROUPS, *[1] * (rows.dim() - 1))
        torch.testing.assert_close(dict(attention.linear_qkv.named_parameters())[name],
                                   expected.view_as(old))
    # Afterwards the group's worst head sits at tau; the others below it.
    after, _ = step_logits(attention, clip, x)
    torch.testing.assert_close(after, naive_max_logits(attention, x), rtol=1e-5, atol=1e-5)
    worst = after.view(GROUPS, -1).max(1).values
    torch.testing.assert_close(worst, torch.minimum(naive.view(GROUPS, -1).max(1).values,
                                                    torch.tensor(threshold)))


def test_nothing_is_recorded_in_eval_mode_and_nothing_clipped_below_tau(megatron):
    model, attention = grouped_attention()
    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(2))
    clip = QKClip([model], float(naive_max_logits(attention, x).max()) + 1)
    attention.eval()
    attention(x, causal_attention_mask(S))
    assert clip.apply(optimizer=None) == {}
    weight = attention.linear_qkv.weight.detach().clone()
    step_logits(attention, clip, x)
    assert torch.equal(attention.linear_qkv.weight, weight)


@pytest.mark.parametrize("case", ["query_latent", "no_query_latent"])
def test_latent_attention_clip_scales_the_head_components(megatron, case):
    settings, _ = CASES[case]
    attention = latent_attention(settings, CASES[case][1])
    c = attention.config
    x = torch.randn(12, B, attention.config.hidden_size,
                    generator=torch.Generator().manual_seed(1))
    clip = QKClip([attention], 1.0)
    attention.train()
    attention(x, causal_attention_mask(12))
    s_max = attention.core_attention.current_max_attn_logits.clone()
    q_proj = attention.linear_q_proj if c.q_lora_rank is None else attention.linear_q_up_proj
    q_old = q_proj.weight.detach().clone()
    kv_old = attention.linear_kv_up_proj.weight.detach().clone()
    down_old = attention.linear_kv_down_proj.weight.detach().clone()
    threshold = float(s_max.sort().values[1])
    clip.threshold = threshold
    clip.apply(optimizer=None)
    gamma = (threshold / s_max).clamp(max=1)[:, None, None]
    dn, dr, dv = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
    q_expected = q_old.view(-1, dn + dr, q_old.size(1)).clone()
    q_expected[:, :dn] *= gamma.sqrt()
    q_expected[:, dn:] *= gamma
    kv_expected = kv_old.view(-1, dn + dv, kv_old.size(1)).clone()
    kv_expected[:, :dn] *= gamma.sqrt()
    torch.testing.assert_close(q_proj.weight, q_expected.view_as(q_old))
    torch.testing.assert_close(attention.linear_kv_up_proj.weight, kv_expected.view_as(kv_old))
    assert torch.equal(attention.linear_kv_down_proj.weight, down_old)  # shared RoPE key
    attention(x, causal_attention_mask(12))
    torch.testing.assert_close(attention.core_attention.current_max_attn_logits,
                               torch.clamp(s_max, max=threshold), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threshold", [0, -1.0, float("nan"), float("inf")])
def test_bad_threshold_is_a_config_error(threshold):
    with pytest.raises(ConfigError, match="qk_clip_threshold"):
        QKClip([], threshold)
