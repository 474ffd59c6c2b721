"""Loss-free bias balancing, balance losses and load metrics."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megamoe import MoEConfig
from megamoe.balancing import maxvio, sequence_aux_loss, step_balancing, switch_aux_loss, z_loss
from megamoe.layer import MoELayer
from mock_ranks import expert_parallel_replica, run_ranks
from megamoe.routing import ROUTERS
from megamoe.settings import deep_merge

D = 16
BIAS = {"methods": "bias"}


def config(**changes):
    """The tiny config with nested `changes` (e.g. balancing={"methods": "bias"})."""
    return MoEConfig.from_dict(deep_merge(dict(hidden_size=D, num_experts=8, ffn_hidden_size=16,
                                               topk=2), changes))


@pytest.mark.slow
@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_loss_free_bias_drives_maxvio_below_005(score_function):
    torch.manual_seed(1)
    router = ROUTERS["topk"](config(balancing=BIAS, router={"score_function": score_function}))
    with torch.no_grad():
        router.weight.mul_(5)
    skew = torch.randn(D)

    def load_maxvio():
        router.eval()
        with torch.no_grad():
            counts = router(torch.randn(32768, D) + skew).selected_TE.sum(0).float()
        router.train()
        return float(maxvio(counts))

    assert load_maxvio() > 1.0  # deliberately skewed
    with torch.no_grad():
        for _ in range(500):
            routing = router(torch.randn(4096, D) + skew)
            router.record(routing, {})
            step_balancing(router)
    assert load_maxvio() < 0.05


def test_bias_update_rule_and_mean_centering():
    for centering in (False, True):
        router = ROUTERS["topk"](config(balancing={"methods": "bias", "bias_update_rate": 0.01,
                                                   "bias_mean_centering": centering}))
        selected = torch.zeros(10, 8, dtype=torch.bool)
        selected[:, 0] = selected[:5, 1] = selected[:5, 2] = selected[5:, 3] = True
        selected[:, 4] = selected[:, 5] = True  # counts: 10, 5, 5, 5, 10, 10, 0, 0 (mean 5.625)
        router.load.record(selected, selected)
        step_balancing(router)
        expected = torch.tensor([-1, 1, 1, 1, -1, -1, 1, 1], dtype=torch.float32) * 0.01
        if centering:
            expected -= expected.mean()
        torch.testing.assert_close(router.expert_bias, expected)


def test_counts_only_kept_training_forwards():
    torch.manual_seed(0)
    layer = MoELayer(config(balancing=BIAS))
    x = torch.randn(8, 2, D, requires_grad=True)
    layer.eval()
    layer(x)
    assert layer.router.load.empty  # eval forwards are not counted
    layer.train()
    for reentrant in (True, False):
        out = checkpoint(lambda h: layer(h)[0], x, use_reentrant=reentrant)
        out.sum().backward()  # the backward recomputes the forward
    counts = layer.router.load.stats.selected_E
    assert float(counts.sum()) == 2 * 16 * 2  # two kept forwards of 16 tokens, top-2


def test_bias_stays_fp32_under_bf16_cast_and_round_trips():
    layer = MoELayer(config(balancing=BIAS))
    layer.router.expert_bias.copy_(torch.arange(8) * 1e-3 + 1.0)
    layer.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32
    assert layer.router.weight.dtype == torch.bfloat16
    torch.testing.assert_close(layer.router.expert_bias, torch.arange(8) * 1e-3 + 1.0)
    state = layer.state_dict()
    fresh = MoELayer(config(balancing=BIAS))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.router.expert_bias, torch.arange(8) * 1e-3 + 1.0)


def naive_switch_loss(probs, selected):
    E = probs.shape[1]
    f = [float(selected[:, e].sum()) / float(selected.sum()) for e in range(E)]
    P = [float(probs[:, e].mean()) for e in range(E)]
    return E * sum(fi * pi for fi, pi in zip(f, P))


def test_switch_and_z_loss_match_formulas():
    torch.manual_seed(0)
    logits = torch.randn(32, 8)
    probs = logits.softmax(-1)
    selected = torch.zeros(32, 8, dtype=torch.bool).scatter_(1, probs.topk(2).indices, True)
    aux = switch_aux_loss(probs, selected, selected.sum(0).float())
    assert float(aux) == pytest.approx(naive_switch_loss(probs, selected), rel=1e-5)
    expected_z = sum(float(torch.logsumexp(row, 0)) ** 2 for row in logits) / 32
    assert float(z_loss(logits, selected)) == pytest.approx(expected_z, rel=1e-5)


def test_sequence_aux_loss_is_mean_of_per_sequence_losses():
    torch.manual_seed(0)
    S, B = 6, 3
    probs = torch.randn(S * B, 8).softmax(-1)
    selected = torch.zeros(S * B, 8, dtype=torch.bool).scatter_(1, probs.topk(2).indices, True)
    per_sequence = [naive_switch_loss(probs.view(S, B, 8)[:, b], selected.view(S, B, 8)[:, b])
                    for b in range(B)]
    got = float(sequence_aux_loss(probs, selected, S, B))
    assert got == pytest.approx(sum(per_sequence) / B, rel=1e-5)


def test_aux_loss_uses_the_routing_actually_used():
    """With a bias and group limits, the loss counts the experts chosen after both."""
    torch.manual_seed(0)
    layer = MoELayer(config(balancing={"methods": "aux_loss"},
                            router={"num_groups": 4, "groups_per_token": 1,
                                    "score_function": "sigmoid"}))
    x = torch.randn(16, D)
    routing = layer.router(x)
    losses = layer.balance_losses(routing, 16, 1)
    scores = (x @ layer.router.weight.detach().t()).sigmoid()
    from reference import naive_topk
    chosen = naive_topk(scores, 2, num_groups=4, groups_per_token=1)
    selected = torch.zeros(16, 8, dtype=torch.bool)
    for t, c in enumerate(chosen):
        selected[t, c] = True
    normalised = scores / scores.sum(-1, keepdim=True)
    assert float(losses["aux_loss"].detach()) == pytest.approx(naive_switch_loss(normalised, selected),
                                                      rel=1e-5)


def test_global_aux_loss_identical_at_ep1_and_mock_ep4():
    """The global aux loss counts over every replica (here 4 data-parallel ranks): the mean of
    the per-rank losses (what data-parallel gradient averaging trains) is the one-rank loss."""
    torch.manual_seed(0)
    layer = MoELayer(config(balancing={"methods": "global_aux_loss", "z_loss_coeff": 1e-3}))
    x = torch.randn(4, 8, D)  # 4 ranks x 8 tokens
    ref = layer.balance_losses(layer.router(x.reshape(-1, D)), 32, 1)

    def rank(comm):
        replica = expert_parallel_replica(layer, comm)
        return replica.balance_losses(replica.router(x[comm.rank]), 8, 1)

    per_rank = run_ranks(4, rank)
    for name in ("global_aux_loss", "z_loss"):
        mean = sum(float(r[name].detach()) for r in per_rank) / 4
        assert mean == pytest.approx(float(ref[name].detach()), rel=1e-6, abs=1e-7)


def test_heterogeneous_layers_balance_independently():
    torch.manual_seed(0)
    model = nn.ModuleList([
        MoELayer(config(balancing=BIAS, num_experts=4)),
        MoELayer(config(balancing=BIAS, num_experts=16, topk=4,
                        router={"score_function": "sigmoid"})),
        MoELayer(config(balancing=BIAS, router={"kind": "top_p"}, num_experts=8)),
        MoELayer(config(balancing={"methods": "aux_loss"}, num_experts=8)),
    ])
    for number, layer in enumerate(model, start=1):
        layer.set_layer_number(number)
    x = torch.randn(32, 2, D)
    for layer in model:
        layer(x)[0].sum().backward()
    metrics = step_balancing(model)
    for number, layer in enumerate(model, start=1):
        assert len(metrics[f"moe/layer{number}/load"]) == layer.cfg.num_experts
        assert layer.router.load.empty
    for layer in model[:3]:
        assert layer.router.expert_bias.abs().sum() > 0
    assert metrics["moe/layer2/experts_per_token"] == 4.0
    assert metrics["moe/layer4/aux_loss"] > 0


def test_metrics_match_counts():
    torch.manual_seed(0)
    layer = MoELayer(config(balancing={"methods": "none"}, dispatcher={"capacity_factor": 1.0}))
    layer.set_layer_number(3)
    x1, x2 = torch.randn(32, 1, D), torch.randn(32, 1, D)
    selections = []
    for x in (x1, x2):
        layer(x)
        selections.append(layer.router(x.reshape(-1, D)).selected_TE)
    counts = (selections[0].sum(0) + selections[1].sum(0)).float()
    metrics = step_balancing(layer)
    assert metrics["moe/layer3/maxvio_global"] == pytest.approx(float(maxvio(counts)))
    mean_batch = (float(maxvio(selections[0].sum(0).float())) +
                  float(maxvio(selections[1].sum(0).float()))) / 2
    assert metrics["moe/layer3/maxvio_batch"] == pytest.approx(mean_batch)
    cv = float(counts.std(unbiased=False) / counts.mean())
    assert metrics["moe/layer3/cv"] == pytest.approx(cv)
    assert metrics["moe/layer3/experts_per_token"] == 2.0
    assert 0 < metrics["moe/layer3/dropped_fraction"] < 1


def test_biases_identical_on_all_mock_ranks_after_updates():
    torch.manual_seed(0)
    layer = MoELayer(config(balancing=BIAS, router={"score_function": "sigmoid"}))
    inputs = torch.randn(20, 4, 16, 1, D)

    def rank(comm):
        replica = expert_parallel_replica(layer, comm)
        for step in range(20):
            replica(inputs[step, comm.rank])
            step_balancing(replica, replica_comm=comm)
        return replica.router.expert_bias.clone()

    biases = run_ranks(4, rank)
    assert all(torch.equal(b, biases[0]) for b in biases)
    assert biases[0].abs().sum() > 0


def test_balance_losses_reach_the_gradient_but_not_the_output():
    torch.manual_seed(0)
    plain = MoELayer(config(balancing={"methods": "none"}))
    with_losses = MoELayer(config(balancing={"methods": "aux_loss", "aux_loss_coeff": 0.5,
                                           "z_loss_coeff": 0.1}))
    with_losses.load_state_dict(plain.state_dict())
    x, grad = torch.randn(8, 2, D), torch.randn(8, 2, D)
    out_plain, _ = plain(x)
    out_plain.backward(grad)
    out, _ = with_losses(x)
    out.backward(grad)
    assert torch.equal(out, out_plain)
    routing = with_losses.router(x.reshape(-1, D))
    losses = with_losses.balance_losses(routing, 8, 2)
    weighted = 0.5 * losses["aux_loss"] + 0.1 * losses["z_loss"]
    (loss_grad,) = torch.autograd.grad(weighted, with_losses.router.weight)
    torch.testing.assert_close(with_losses.router.weight.grad - plain.router.weight.grad, loss_grad)
    torch.testing.assert_close(with_losses.experts.fc1_weight.grad, plain.experts.fc1_weight.grad)
