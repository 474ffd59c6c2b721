"""Latent MoE (`experts.latent_size`) against transformers' `NemotronHMoE` (pure torch) on the
same weights: the layer output and every gradient, at EP=1 and at EP=2 (mock ranks); the
dispatched rows are latent-wide; its refusals. On a GPU with Transformer Engine, also against
Megatron-Core's own latent MoE layer."""
import importlib.util

import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

from megamoe import ConfigError, MoEConfig
from megamoe.layer import MoELayer
from mock_ranks import run_ranks

D, LATENT, F, FS, E, K, T = 32, 8, 16, 24, 8, 2, 40
SCALE, BIAS = 2.5, torch.linspace(-0.05, 0.1, E)


def nemotron_block() -> NemotronHMoE:
    config = NemotronHConfig(hidden_size=D, moe_latent_size=LATENT, n_routed_experts=E,
                             num_experts_per_tok=K, moe_intermediate_size=F,
                             moe_shared_expert_intermediate_size=FS, n_group=2, topk_group=1,
                             routed_scaling_factor=SCALE, norm_topk_prob=True,
                             mlp_hidden_act="relu2", mlp_bias=False)
    torch.manual_seed(0)
    block = NemotronHMoE(config).float()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
        block.gate.e_score_correction_bias.copy_(BIAS)
    return block


def megamoe_config() -> MoEConfig:
    """NemotronH's MoE in megamoe's terms: sigmoid scores, DeepSeek-V3 group limits (a group
    scored by its best 2), the correction bias as the loss-free bias, squared-ReLU experts."""
    return MoEConfig.from_dict({
        "hidden_size": D, "num_experts": E, "ffn_hidden_size": F, "topk": K,
        "router": {"score_function": "sigmoid", "topk_scaling_factor": SCALE, "num_groups": 2,
                   "groups_per_token": 1, "group_score_topk": 2},
        "balancing": {"methods": "bias"},
        "experts": {"activation": "squared_relu", "latent_size": LATENT},
        "shared_expert": {"ffn_hidden_size": FS}})


def copy_weights(layer: MoELayer, block: NemotronHMoE, experts: slice) -> None:
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.router.expert_bias.copy_(block.gate.e_score_correction_bias)
        layer.experts.fc1_weight.copy_(block.experts.up_proj[experts])
        layer.experts.fc2_weight.copy_(block.experts.down_proj[experts])
        layer.shared_experts.linear_fc1.weight.copy_(block.shared_experts.up_proj.weight)
        layer.shared_experts.linear_fc2.weight.copy_(block.shared_experts.down_proj.weight)
        layer.fc1_latent_proj.weight.copy_(block.fc1_latent_proj.weight)
        layer.fc2_latent_proj.weight.copy_(block.fc2_latent_proj.weight)


def grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {
        "gate": layer.router.weight.grad, "up_proj": layer.experts.fc1_weight.grad,
        "down_proj": layer.experts.fc2_weight.grad,
        "shared_up": layer.shared_experts.linear_fc1.weight.grad,
        "shared_down": layer.shared_experts.linear_fc2.weight.grad,
        "fc1_latent": layer.fc1_latent_proj.weight.grad,
        "fc2_latent": layer.fc2_latent_proj.weight.grad}


def reference_grads(block: NemotronHMoE) -> dict[str, torch.Tensor]:
    return {"gate": block.gate.weight.grad, "up_proj": block.experts.up_proj.grad,
            "down_proj": block.experts.down_proj.grad,
            "shared_up": block.shared_experts.up_proj.weight.grad,
            "shared_down": block.shared_experts.down_proj.weight.grad,
            "fc1_latent": block.fc1_latent_proj.weight.grad,
            "fc2_latent": block.fc2_latent_proj.weight.grad}


def inputs():
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    return x, weights


def reference(block: NemotronHMoE, x: torch.Tensor, weights: torch.Tensor):
    leaf = x.clone().requires_grad_()
    out = block(leaf.view(1, T, D)).view(T, D)
    (out * weights).sum().backward()
    return out.detach(), leaf.grad, reference_grads(block)


def assert_relative(actual, expected, what):
    scale = expected.abs().max().clamp_min(1e-12)
    error = float((actual - expected).abs().max() / scale)
    assert error <= 1e-5, f"{what}: relative error {error:.2e}"


def test_latent_layer_equals_nemotron_h_at_ep1():
    block = nemotron_block()
    x, weights = inputs()
    expected, expected_dx, expected_grads = reference(block, x, weights)
    layer = MoELayer(megamoe_config())
    copy_weights(layer, block, slice(None))
    leaf = x.clone().requires_grad_()
    out = layer(leaf.view(T, 1, D))[0].view(T, D)
    (out * weights).sum().backward()
    assert_relative(out.detach(), expected, "output")
    assert_relative(leaf.grad, expected_dx, "input gradient")
    for name, grad in grads(layer).items():
        assert_relative(grad, expected_grads[name], name)


def test_latent_layer_equals_nemotron_h_at_ep2_with_latent_rows():
    """Two expert-parallel ranks, each with half the tokens and half the experts: each rank's
    output is the reference's on its tokens; expert gradients are the reference's for the
    rank's experts, and the replicated weights' gradients sum to the reference's. Every row
    the all-to-all moves is latent-wide."""
    block = nemotron_block()
    x, weights = inputs()
    expected, expected_dx, expected_grads = reference(block, x, weights)
    widths = set()

    def rank_run(comm):
        layer = MoELayer(megamoe_config(), ep_comm=comm)
        local = E // 2
        copy_weights(layer, block, slice(comm.rank * local, (comm.rank + 1) * local))
        exchange = comm.all_to_all

        def recording_all_to_all(rows, *args):
            if rows.is_floating_point():  # token rows, not the split counts
                widths.add(rows.shape[-1])
            return exchange(rows, *args)

        comm.all_to_all = recording_all_to_all
        mine = slice(comm.rank * T // 2, (comm.rank + 1) * T // 2)
        leaf = x[mine].clone().requires_grad_()
        out = layer(leaf.view(T // 2, 1, D))[0].view(T // 2, D)
        (out * weights[mine]).sum().backward()
        return out.detach(), leaf.grad, grads(layer)

    results = run_ranks(2, rank_run)
    assert_relative(torch.cat([r[0] for r in results]), expected, "output")
    assert_relative(torch.cat([r[1] for r in results]), expected_dx, "input gradient")
    assert_relative(torch.cat([r[2]["up_proj"] for r in results]), expected_grads["up_proj"],
                    "up_proj")
    assert_relative(torch.cat([r[2]["down_proj"] for r in results]), expected_grads["down_proj"],
                    "down_proj")
    for name in ("gate", "shared_up", "shared_down", "fc1_latent", "fc2_latent"):
        assert_relative(results[0][2][name] + results[1][2][name], expected_grads[name], name)
    assert widths == {LATENT}


def test_the_projections_are_saved_under_megatrons_names():
    layer = MoELayer(megamoe_config())
    assert {"fc1_latent_proj.weight", "fc2_latent_proj.weight"} <= set(layer.state_dict())
    assert layer.experts.fc1_weight.shape == (E, F, LATENT)


@pytest.mark.parametrize("latent", [D, D + 1, 0, -4])
def test_a_latent_size_not_below_the_hidden_size_is_refused_in_one_line(latent):
    with pytest.raises(ConfigError, match=f"experts.latent_size={latent} must be in 1..{D - 1}"):
        MoEConfig.from_dict({"hidden_size": D, "num_experts": E, "ffn_hidden_size": F,
                             "topk": K, "experts": {"latent_size": latent}})


HAS_TE_GPU = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(not HAS_TE_GPU, reason="Megatron-Core's latent MoE layer asserts Transformer "
                                           "Engine (tools/gpu_check.sh runs this on a GPU)")
def test_latent_layer_equals_megatron_cores_latent_moe_layer():
    """Megatron-Core's own MoELayer with moe_latent_size (Transformer Engine's spec) and
    megamoe's layer built from the same TransformerConfig, on the same weights: the output and
    the input's gradient (fp32, TF32 off; relative 1e-4 for TE's GEMMs)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module

    from megamoe.megatron.moe_module import MegatronMoELayer
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from tiny_models import tiny_transformer_config

    torch.backends.cuda.matmul.allow_tf32 = False
    setup_megatron(seed=3)
    try:
        tc = tiny_transformer_config(num_layers=1, hidden_size=D, num_attention_heads=4,
                                     num_moe_experts=E, moe_router_topk=K,
                                     moe_ffn_hidden_size=F, moe_latent_size=LATENT,
                                     moe_router_load_balancing_type="none",
                                     moe_aux_loss_coeff=0.0, moe_grouped_gemm=True)
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=E, moe_grouped_gemm=True)
        theirs = build_module(spec.submodules.mlp, config=tc).cuda()
        ours = MegatronMoELayer(tc).cuda()
        sources = {"router.weight": ours.router.weight,
                   "fc1_latent_proj.weight": ours.fc1_latent_proj.weight,
                   "fc2_latent_proj.weight": ours.fc2_latent_proj.weight}
        sources.update({f"experts.linear_fc1.weight{e}": ours.experts.fc1_weight[e]
                        for e in range(E)})
        sources.update({f"experts.linear_fc2.weight{e}": ours.experts.fc2_weight[e]
                        for e in range(E)})
        with torch.no_grad():
            for name, param in theirs.named_parameters():
                assert name in sources, f"no megamoe weight for Megatron's {name}"
                param.copy_(sources[name])
        x = torch.randn(8, 2, D, generator=torch.Generator().manual_seed(4)).cuda()
        outputs, grads = [], []
        for layer in (theirs, ours):
            leaf = x.clone().requires_grad_()
            out = layer(leaf)[0]
            out.square().sum().backward()
            outputs.append(out.detach())
            grads.append(leaf.grad)
        for name, (mine, reference) in {"output": (outputs[1], outputs[0]),
                                        "input gradient": (grads[1], grads[0])}.items():
            error = float((mine - reference).abs().max() / reference.abs().max())
            assert error <= 1e-4, f"{name}: relative error {error:.2e}"
    finally:
        teardown_megatron()
