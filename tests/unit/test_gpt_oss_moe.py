"""GPT-OSS's MoE block in megamoe (clamped SwiGLU, per-expert fc1/fc2 biases, a router with a
bias, softmax over the chosen experts) against transformers' `GptOssMLP` on the same weights,
and its pieces against naive references written here."""
import math

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from megamoe import ConfigError, MoEConfig
from megamoe.experts import GROUPED_MM, LOOP, expert_mlp
from megamoe.experts.activations import expert_activation
from megamoe.layer import MoELayer
from megamoe.optim.params import classify

H, F, E, K = 16, 8, 4, 2
LIMIT = 0.6  # small, so that tiny random weights reach the clamps


def naive_clamped_swiglu(gate, up, limit):
    """The model card's formula, elementwise through `where` (not clamp)."""
    g = torch.where(gate > limit, torch.full_like(gate, limit), gate)
    u = torch.where(up > limit, torch.full_like(up, limit),
                    torch.where(up < -limit, torch.full_like(up, -limit), up))
    return (u + 1) * g / (1 + torch.exp(-1.702 * g))


def experts_config(**experts):
    return MoEConfig.from_dict(dict(hidden_size=H, num_experts=E, ffn_hidden_size=F, topk=K,
                                    experts=experts))


def test_clamped_swiglu_forward_and_written_backward_against_autograd():
    """Values on both sides of each clamp, and exactly on it (where the gradient passes, as
    torch.clamp and the reference's `where` pass it)."""
    torch.manual_seed(0)
    gate = torch.cat([torch.randn(40) * 2, torch.tensor([LIMIT, -LIMIT, 0.0])])
    up = torch.cat([torch.randn(40) * 2, torch.tensor([LIMIT, -LIMIT, 0.0])])
    h = torch.cat([gate, up]).view(1, -1).double()  # one row: [gate; up]
    activation = expert_activation(experts_config(activation="clamped_swiglu",
                                                  swiglu_limit=LIMIT).experts)
    leaf = h.clone().requires_grad_()
    expected = naive_clamped_swiglu(*leaf.chunk(2, dim=-1), LIMIT)
    grad_out = torch.randn_like(expected)
    expected_grad, = torch.autograd.grad(expected, leaf, grad_out)
    torch.testing.assert_close(activation.forward(h), expected.detach())
    torch.testing.assert_close(activation.backward(h, grad_out), expected_grad)
    assert (gate.abs() > LIMIT).sum() > 5 and (up.abs() > LIMIT).sum() > 5  # clamps happened


def naive_biased_rows(x, counts, fc1, fc2, b1, b2, limit):
    """Row by row: expert e's biased MLP (fc1 rows [gate; up]) on each of its rows."""
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    rows = []
    for i, e in enumerate(experts):
        h = fc1[e] @ x[i] + b1[e]
        rows.append(fc2[e] @ naive_clamped_swiglu(h[:F], h[F:], limit) + b2[e])
    return torch.stack(rows)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("kernel", [
    pytest.param(GROUPED_MM, id="grouped_mm", marks=pytest.mark.skipif(
        not hasattr(torch.nn.functional, "grouped_mm"), reason="no grouped_mm")),
    pytest.param(LOOP, id="loop")])
def test_biased_experts_match_naive_rows_with_empty_experts(kernel, device):
    """Forward and the gradients of x, both weights and both biases; an expert with no rows gets
    exactly zero bias gradients."""
    torch.manual_seed(1)
    counts = [3, 0, 5, 4]
    leaves = tuple(t.to(device).requires_grad_() for t in (
        torch.randn(sum(counts), H), torch.randn(E, 2 * F, H) / 2, torch.randn(E, H, F) / 2,
        torch.randn(E, 2 * F) / 2, torch.randn(E, H)))
    x, fc1, fc2, b1, b2 = leaves
    activation = expert_activation(experts_config(activation="clamped_swiglu",
                                                  swiglu_limit=LIMIT).experts)
    out = expert_mlp(x, counts, fc1, fc2, activation, gemm=kernel, fc1_bias_LF=b1,
                     fc2_bias_LD=b2)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad_out)
    expected_out = naive_biased_rows(x, counts, fc1, fc2, b1, b2, LIMIT)
    expected = torch.autograd.grad(expected_out, leaves, grad_out)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    for name, g, e in zip(("x", "fc1", "fc2", "b1", "b2"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert float(got[3][1].abs().sum()) == 0.0 and float(got[4][1].abs().sum()) == 0.0


def gpt_oss_mlp(seed: int) -> GptOssMLP:
    """transformers' GPT-OSS MoE block with random weights (its biases included)."""
    config = GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=E,
                          num_experts_per_tok=K, swiglu_limit=LIMIT, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    mlp = GptOssMLP(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return mlp


def megamoe_layer_from(mlp: GptOssMLP) -> MoELayer:
    """megamoe's layer with the same weights: gate_up_proj [E, H, 2F] holds gate and up in its
    even and odd columns; megamoe's fc1 is [E, 2F, H] with rows [gate; up]."""
    cfg = MoEConfig.from_dict(dict(
        hidden_size=H, num_experts=E, ffn_hidden_size=F, topk=K,
        router={"bias": True}, balancing={"methods": "none"},
        experts={"activation": "clamped_swiglu", "swiglu_limit": LIMIT, "bias": True}))
    layer = MoELayer(cfg)
    experts = mlp.experts
    with torch.no_grad():
        layer.router.weight.copy_(mlp.router.weight)
        layer.router.bias.copy_(mlp.router.bias)
        gate_up = experts.gate_up_proj
        layer.experts.fc1_weight.copy_(
            torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=2).transpose(1, 2))
        bias = experts.gate_up_proj_bias
        layer.experts.fc1_bias.copy_(torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1).reshape(-1))
        layer.experts.fc2_weight.copy_(experts.down_proj.transpose(1, 2))
        layer.experts.fc2_bias.copy_(experts.down_proj_bias.reshape(-1))
    return layer


def test_moe_layer_matches_transformers_gpt_oss_mlp_forward_and_gradients():
    """Same output and the same gradients (input, router weight and bias, experts' weights and
    biases, mapped back to GPT-OSS's layout) as transformers' GptOssMLP; some activations were
    clamped."""
    mlp = gpt_oss_mlp(seed=2)
    layer = megamoe_layer_from(mlp).eval()
    x = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(3))
    x_hf, x_mm = x.clone().requires_grad_(), x.clone().transpose(0, 1).requires_grad_()
    y_hf = mlp(x_hf)[0]
    y_mm = layer(x_mm)[0].transpose(0, 1)  # megamoe takes [S, B, H]
    torch.testing.assert_close(y_mm, y_hf, rtol=1e-5, atol=1e-5)
    grad = torch.randn(y_hf.shape, generator=torch.Generator().manual_seed(4))
    y_hf.backward(grad)
    y_mm.backward(grad)
    torch.testing.assert_close(x_mm.grad.transpose(0, 1), x_hf.grad, rtol=1e-5, atol=1e-5)
    ex, mine = mlp.experts, layer.experts
    fc1 = mine.fc1_weight.grad.transpose(1, 2)  # [E, H, 2F] as [gate | up]
    b1 = mine.fc1_bias.grad.view(E, 2 * F)
    pairs = {
        "router.weight": (layer.router.weight.grad, mlp.router.weight.grad),
        "router.bias": (layer.router.bias.grad, mlp.router.bias.grad),
        "gate_up_proj(gate)": (fc1[..., :F], ex.gate_up_proj.grad[..., 0::2]),
        "gate_up_proj(up)": (fc1[..., F:], ex.gate_up_proj.grad[..., 1::2]),
        "gate_up_proj_bias(gate)": (b1[:, :F], ex.gate_up_proj_bias.grad[:, 0::2]),
        "gate_up_proj_bias(up)": (b1[:, F:], ex.gate_up_proj_bias.grad[:, 1::2]),
        "down_proj": (mine.fc2_weight.grad.transpose(1, 2), ex.down_proj.grad),
        "down_proj_bias": (mine.fc2_bias.grad.view(E, H), ex.down_proj_bias.grad),
    }
    for name, (got, expected) in pairs.items():
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    h = torch.einsum("th,ehf->tef", x.reshape(-1, H), ex.gate_up_proj.detach())
    assert bool((h[..., 0::2] > LIMIT).any()) and bool((h[..., 1::2].abs() > LIMIT).any())


def test_expert_and_router_biases_train_with_adamw_under_muon():
    """The flat stacked biases are vectors (AdamW), the stacked weights Muon's matrices."""
    layer = MoELayer(experts_config(activation="clamped_swiglu", bias=True).merged(
        {"router": {"bias": True}}))
    kinds = {name: treatment.kind for name, _, treatment in classify(layer)}
    assert kinds["experts.fc1_bias"] == kinds["experts.fc2_bias"] == "norm or bias"
    assert kinds["experts.fc1_weight"] == "stacked expert weight"
    assert kinds["router.bias"] == "router"


@pytest.mark.parametrize("experts, message", [
    ({"swiglu_limit": 0.0}, "experts.swiglu_limit=0.0 must be > 0; GPT-OSS uses 7.0"),
    ({"swiglu_limit": -7.0}, "experts.swiglu_limit=-7.0 must be > 0"),
    ({"swiglu_limit": math.nan}, "experts.swiglu_limit=nan is not a finite number"),
    ({"swiglu_limit": math.inf}, "experts.swiglu_limit=inf is not a finite number"),
    ({"activation": "clamped_swiglue"}, "experts.activation='clamped_swiglue' is not one of"),
])
def test_hostile_expert_settings_are_refused_in_one_line(experts, message):
    with pytest.raises(ConfigError) as err:
        experts_config(**experts)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_megatron_lm_flags_build_megatron_cores_own_gpt_oss_moe(tmp_path):
    """Megatron-LM's GPT-OSS MoE flags (`--add-bias-linear`, quick_gelu GLU with
    `glu_linear_offset` 1 and `activation_func_clamp_value`) build megamoe layers with expert and
    router biases and the clamped SwiGLU, which load Megatron-Core's own MoE model's distributed
    checkpoint (its per-expert biases, GLU halves included) and compute its logits."""
    from megatron.core import dist_checkpointing
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import import_module

    from megamoe.megatron.masks import causal_attention_mask
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from tiny_models import tiny_transformer_config

    vocab, seq = 64, 16
    setup_megatron(seed=9)
    try:
        config = tiny_transformer_config(
            num_layers=2, num_moe_experts=E, moe_ffn_hidden_size=F, moe_router_topk=K,
            moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-3, moe_grouped_gemm=False, gated_linear_unit=True,
            activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=LIMIT,
            add_bias_linear=True, bias_activation_fusion=False)
        models = [GPTModel(config, spec, vocab_size=vocab, max_sequence_length=seq,
                           share_embeddings_and_output_weights=False)
                  for spec in (get_gpt_decoder_block_spec(config, use_transformer_engine=False),
                               import_module(("megamoe.megatron.specs", "layer_spec")))]
        theirs, ours = models
        layer = ours.decoder.layers[0].mlp
        assert layer.cfg.experts.bias and layer.cfg.router.bias
        assert (layer.cfg.experts.activation, layer.cfg.experts.swiglu_limit) == (
            "clamped_swiglu", LIMIT)
        with torch.no_grad():
            for name, param in theirs.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        dist_checkpointing.save(theirs.sharded_state_dict(), str(tmp_path))
        ours.load_state_dict(dist_checkpointing.load(ours.sharded_state_dict(), str(tmp_path)))
        tokens = torch.randint(0, vocab, (4, seq), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(seq).expand(4, -1)
        with torch.no_grad():
            expected, got = (model.eval()(tokens, positions, causal_attention_mask(seq))
                             for model in models)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        teardown_megatron()
