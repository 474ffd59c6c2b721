"""Zero-computation experts (`experts.zero_experts`, LongCat-Flash) against transformers'
`LongcatFlashMoE` on the same weights (output and gradients, at EP=1 and EP=2 on mock ranks),
the compute-budget control of their bias against a hand count, their metrics, and their
refusals."""
import pytest
import torch
from transformers import LongcatFlashConfig
from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

from megamoe import ConfigError, MoEConfig
from megamoe.balancing import step_balancing
from megamoe.layer import MoELayer
from mock_ranks import run_ranks

D, F, N, Z, K, T, SCALE = 16, 8, 8, 4, 4, 48, 6.0


def longcat_block() -> LongcatFlashMoE:
    config = LongcatFlashConfig(hidden_size=D, n_routed_experts=N, zero_expert_num=Z,
                                moe_topk=K, expert_ffn_hidden_size=F, hidden_act="silu",
                                routed_scaling_factor=SCALE)
    torch.manual_seed(0)
    block = LongcatFlashMoE(config).float()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.4)
        block.router.e_score_correction_bias.copy_(torch.linspace(-0.02, 0.03, N + Z))
    return block


def megamoe_config(**experts) -> MoEConfig:
    """LongCat's MoE in megamoe's terms: softmax over all N + Z choices (not renormalised),
    scaled, the correction bias as the expert bias, SwiGLU experts, Z identity experts."""
    return MoEConfig.from_dict({
        "hidden_size": D, "num_experts": N, "ffn_hidden_size": F, "topk": K,
        "router": {"score_function": "softmax", "pre_softmax": True,
                   "topk_scaling_factor": SCALE},
        "balancing": {"methods": "bias"},
        "experts": {"zero_experts": Z, **experts}})


def copy_weights(layer: MoELayer, block: LongcatFlashMoE, experts: slice) -> None:
    with torch.no_grad():
        layer.router.weight.copy_(block.router.classifier.weight)
        layer.router.expert_bias.copy_(block.router.e_score_correction_bias)
        layer.experts.fc1_weight.copy_(block.experts.gate_up_proj[experts])
        layer.experts.fc2_weight.copy_(block.experts.down_proj[experts])


def inputs():
    return (torch.randn(T, D, generator=torch.Generator().manual_seed(1)),
            torch.randn(T, D, generator=torch.Generator().manual_seed(2)))


def reference(block, x, weights):
    leaf = x.clone().requires_grad_()
    out = block(leaf.view(1, T, D)).view(T, D)
    (out * weights).sum().backward()
    return out.detach(), leaf.grad, {"router": block.router.classifier.weight.grad,
                                     "fc1": block.experts.gate_up_proj.grad,
                                     "fc2": block.experts.down_proj.grad}


def run_layer(layer, x, weights):
    leaf = x.clone().requires_grad_()
    out = layer(leaf.view(-1, 1, D))[0].view(-1, D)
    (out * weights).sum().backward()
    return out.detach(), leaf.grad, {"router": layer.router.weight.grad,
                                     "fc1": layer.experts.fc1_weight.grad,
                                     "fc2": layer.experts.fc2_weight.grad}


def test_the_layer_equals_longcat_flash_and_skips_identity_tokens():
    block = longcat_block()
    x, weights = inputs()
    expected, expected_dx, expected_grads = reference(block, x, weights)
    layer = MoELayer(megamoe_config())
    copy_weights(layer, block, slice(None))
    seen = []
    dispatch = layer.dispatcher.dispatch

    def counting_dispatch(x_TD, routing):
        seen.append(int(routing.routing_map_TE.sum()))
        return dispatch(x_TD, routing)

    layer.dispatcher.dispatch = counting_dispatch
    out, dx, got = run_layer(layer, x, weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, expected_dx, rtol=1e-5, atol=1e-6)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6)
    _, chosen = (block.router.classifier(x).softmax(-1)
                 + block.router.e_score_correction_bias).topk(K)
    real = int((chosen < N).sum())
    assert seen == [real] and 0 < real < T * K  # only real assignments were dispatched


def test_the_layer_equals_longcat_flash_at_ep2():
    block = longcat_block()
    x, weights = inputs()
    expected, expected_dx, expected_grads = reference(block, x, weights)

    def rank_run(comm):
        layer = MoELayer(megamoe_config(), ep_comm=comm)
        copy_weights(layer, block, slice(comm.rank * N // 2, (comm.rank + 1) * N // 2))
        mine = slice(comm.rank * T // 2, (comm.rank + 1) * T // 2)
        return run_layer(layer, x[mine], weights[mine])

    results = run_ranks(2, rank_run)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), expected, rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), expected_dx, rtol=1e-5,
                               atol=1e-6)
    for name in ("fc1", "fc2"):
        torch.testing.assert_close(torch.cat([r[2][name] for r in results]),
                                   expected_grads[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][2]["router"] + results[1][2]["router"],
                               expected_grads["router"], rtol=1e-5, atol=1e-6)


def test_the_budget_steers_real_experts_and_leaves_identity_biases():
    """One step, counted by hand: each real expert's bias moves by u * sign(T K_e / N - c_i),
    the identity experts' stay 0; the metrics count real and identity choices apart."""
    layer = MoELayer(megamoe_config(real_experts_per_token=3.0))
    x, _ = inputs()
    seen = []
    layer.router.register_forward_hook(lambda mod, args, out: seen.append(out.selected_TE))
    layer(x.view(T, 1, D))[0].sum().backward()
    metrics = step_balancing(layer)
    chosen = seen[0]
    counts = chosen[:, :N].sum(0).float()
    expected = 1e-3 * torch.sign(T * 3.0 / N - counts)
    torch.testing.assert_close(layer.router.expert_bias[:N], expected)
    assert torch.equal(layer.router.expert_bias[N:], torch.zeros(Z))
    real = float(chosen[:, :N].sum()) / T
    assert metrics["moe/layer0/experts_per_token"] == pytest.approx(real)
    assert metrics["moe/layer0/zero_experts_per_token"] == pytest.approx(K - real)
    assert len(metrics["moe/layer0/load"]) == N


def test_the_budget_is_reached():
    """Trained by the bias alone (the router's weights fixed), the mean number of real experts
    per token settles near the budget, from a router that starts far from it."""
    layer = MoELayer(megamoe_config(real_experts_per_token=2.0)).requires_grad_(False)
    layer.cfg.balancing.bias_update_rate = 2e-3
    with torch.no_grad():
        layer.router.expert_bias[:N] = -0.1  # identity experts favoured at the start
    x = torch.randn(256, 1, D, generator=torch.Generator().manual_seed(3))
    history = []
    for _ in range(300):
        layer(x)
        history.append(step_balancing(layer)["moe/layer0/experts_per_token"])
    assert history[0] < 1.0 and abs(sum(history[-20:]) / 20 - 2.0) < 0.1


@pytest.mark.parametrize("tree, match", [
    ({"router": {"kind": "threshold"}}, "identity experts are chosen in a top-k"),
    ({"router": {"num_groups": 2, "groups_per_token": 1}}, "splits real experts only"),
    ({"balancing": {"methods": "quantile"}}, "use 'bias'"),
    ({"balancing": {"methods": "bias", "bias_mean_centering": True}}, "cancel the compute"),
    ({"experts": {"zero_experts": -1}}, "must be a whole number >= 0"),
    ({"experts": {"zero_experts": Z, "real_experts_per_token": K + 1}}, "in \\(0, topk=4\\]"),
    ({"experts": {"zero_experts": 0, "real_experts_per_token": 2.0}},
     "needs experts.zero_experts > 0"),
])
def test_settings_zero_experts_cannot_honour_are_refused_in_one_line(tree, match):
    raw = {"hidden_size": D, "num_experts": N, "ffn_hidden_size": F, "topk": K,
           "experts": {"zero_experts": Z}}
    for key, value in tree.items():
        raw[key] = {**raw.get(key, {}), **value}
    with pytest.raises(ConfigError, match=match) as err:
        MoEConfig.from_dict(raw)
    assert "\n" not in str(err.value)
