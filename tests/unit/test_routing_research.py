"""Expert-threshold, Sinkhorn and BASE routing, Skywork-MoE's normalisation and adaptive
coefficient, and the ERC loss, against naive references and EP=1 vs mock EP=N."""
import itertools
import math

import pytest
import torch

from megamoe import MoEConfig
from megamoe.balancing import step_balancing
from megamoe.errors import ConfigError
from megamoe.layer import MoELayer
from mock_ranks import expert_parallel_replica, run_ranks
from megamoe.routing import ROUTERS
from megamoe.routing.base_layers import balanced_assignment
from megamoe.routing.sinkhorn import sinkhorn_potentials
from megamoe.settings import deep_merge

from reference import naive_expert

D, E = 16, 8


def cfg(**changes):
    """The tiny config with nested `changes` (e.g. router={"kind": "sinkhorn"})."""
    base = dict(hidden_size=D, num_experts=E, ffn_hidden_size=12, topk=2,
                balancing={"methods": "none"})
    return MoEConfig.from_dict(deep_merge(base, changes))


def threshold_cfg(**settings):
    """A top-1 expert-threshold router with these router settings."""
    return cfg(router={"kind": "threshold", **settings}, topk=1)


def make_router(config):
    torch.manual_seed(0)
    return ROUTERS[config.router.kind](config)


def logits_of(router, x):
    return x @ router.weight.detach().t()


# Expert-threshold routing --------------------------------------------------------------------

def naive_kth_largest(logits, k):
    return [sorted(logits[:, e].tolist(), reverse=True)[k - 1] for e in range(logits.shape[1])]


def test_threshold_ema_with_bias_correction_over_microbatches():
    """c_t = beta c + (1 - beta) mean of the step's micro-batch cutoffs; threshold c_t / (1 -
    beta^t); k = ceil(N * topk / E)."""
    router = make_router(threshold_cfg(ema_decay=0.9))
    ema, beta = [0.0] * E, 0.9
    torch.manual_seed(1)
    for step in range(1, 4):
        cutoffs = []
        for _ in range(2):  # two micro-batches per step
            x = torch.randn(20, D)
            routing = router(x)
            router.record(routing, {})
            cutoffs.append(naive_kth_largest(logits_of(router, x), math.ceil(20 / E)))
        step_balancing(router)
        ema = [beta * c + (1 - beta) * (a + b) / 2 for c, a, b in zip(ema, *cutoffs)]
        want = torch.tensor([c / (1 - beta ** step) for c in ema])
        torch.testing.assert_close(router.thresholds_E, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", [threshold_cfg(ema_decay=0.9),
                                    cfg(balancing={"methods": "bias",
                                                   "bias_update_rate": 0.1})],
                         ids=["threshold", "bias"])
def test_a_discarded_step_leaves_no_trace_in_the_next_update(config):
    """A rolled-back step's routing (discard_step) does not reach the next step's update: the
    result is that of a router that only saw the next step."""
    discarding, clean = make_router(config), make_router(config)
    torch.manual_seed(2)
    abandoned, kept = torch.randn(20, D), torch.randn(20, D)
    discarding.record(discarding(abandoned), {})
    discarding.discard_step()
    for router in (discarding, clean):
        router.record(router(kept), {})
        step_balancing(router)
    for name, buffer in clean.named_buffers():
        torch.testing.assert_close(dict(discarding.named_buffers())[name], buffer)
    assert any(float(b.abs().sum()) > 0 for n, b in clean.named_buffers()
               if n in ("threshold_ema", "expert_bias"))


def test_threshold_routing_and_gates_match_naive_after_warmup():
    router = make_router(threshold_cfg(warmup_steps=0, capacity=None))
    with torch.no_grad():
        router.weight.mul_(20)
        router.threshold_ema.copy_(torch.linspace(0.5, 1.5, E) * (1 - 0.99))  # corrected: x1
        router.threshold_updates.fill_(1)
    x = torch.randn(40, D)
    logits = logits_of(router, x)
    thresholds = router.thresholds_E.tolist()
    for mode in ("train", "eval"):
        getattr(router, mode)()
        with torch.no_grad():
            routing = router(x)
        for t in range(40):
            chosen = {e for e in range(E) if float(logits[t, e]) >= thresholds[e]}
            assert set(torch.nonzero(routing.selected_TE[t]).flatten().tolist()) == chosen
            for e in chosen:
                assert float(routing.gates_TE[t, e]) == pytest.approx(
                    1 / (1 + math.exp(-float(logits[t, e]))), rel=1e-5)
    per_token = routing.selected_TE.sum(1)
    assert int(per_token.min()) == 0 and int(per_token.max()) > 1  # variable, zero included


def test_threshold_warmup_is_expert_choice_and_training_bounds_hold():
    router = make_router(threshold_cfg(warmup_steps=1, capacity=0.5))
    x = torch.randn(64, D)
    logits = logits_of(router, x)
    k = math.ceil(64 / E)
    routing = router(x)  # warm-up: each expert takes its k best tokens
    for e in range(E):
        best = sorted(range(64), key=lambda t: -float(logits[t, e]))[:k]
        assert set(torch.nonzero(routing.selected_TE[:, e]).flatten().tolist()) == set(best)
    router.record(routing, {})
    step_balancing(router)
    with torch.no_grad():  # thresholds that send every token to expert 0 and none to expert 1
        router.threshold_ema.fill_(0.0)
        router.threshold_ema[0], router.threshold_ema[1] = -1e3, 1e3
    routing = router(x)
    loads = routing.selected_TE.sum(0)
    assert int(loads[0]) == math.floor(1.5 * k) and int(loads[1]) == math.ceil(0.5 * k)
    top_of_0 = sorted(range(64), key=lambda t: -float(logits[t, 0]))[:math.floor(1.5 * k)]
    assert set(torch.nonzero(routing.selected_TE[:, 0]).flatten().tolist()) == set(top_of_0)
    router.eval()
    with torch.no_grad():
        assert int(router(x).selected_TE[:, 0].sum()) == 64  # no bounds at inference


def test_thresholds_frozen_at_inference_and_causal():
    router = make_router(threshold_cfg(warmup_steps=0))
    x = torch.randn(32, D)
    router.record(router(x), {})
    step_balancing(router)
    before = router.thresholds_E.clone()
    router.eval()
    with torch.no_grad():
        whole = router(x).selected_TE
        one_by_one = torch.cat([router(x[t:t + 1]).selected_TE for t in range(32)])
    step_balancing(router)
    torch.testing.assert_close(router.thresholds_E, before)
    assert torch.equal(whole, one_by_one)


def test_thresholds_averaged_over_mock_replicas_and_saved():
    config = threshold_cfg(ema_decay=0.5)
    torch.manual_seed(3)
    x = torch.randn(4, 24, D)
    single = make_router(config)
    cutoffs = torch.tensor([naive_kth_largest(logits_of(single, x[r]), 3) for r in range(4)])

    # Built here, one after the other: the mock's ranks are threads sharing torch's generator.
    routers = [make_router(config) for _ in range(4)]

    def rank(comm):
        router = routers[comm.rank]
        router.record(router(x[comm.rank]), {})
        step_balancing(router, comm)
        return router.state_dict()

    states = run_ranks(4, rank)
    want = cutoffs.mean(0) * 0.5
    for state in states:
        torch.testing.assert_close(state["threshold_ema"], want, rtol=1e-5, atol=1e-6)
        assert float(state["threshold_updates"]) == 1
    fresh = make_router(config)
    fresh.load_state_dict(states[0])
    torch.testing.assert_close(fresh.thresholds_E, want / 0.5)


def test_token_with_no_expert_gets_only_the_shared_expert():
    layer = MoELayer(threshold_cfg(warmup_steps=0).merged({"shared_expert":
                                                           {"ffn_hidden_size": 8}}))
    with torch.no_grad():
        layer.router.threshold_ema.fill_(1e3)  # nobody clears
        layer.router.threshold_updates.fill_(1)
    layer.eval()
    x = torch.randn(5, 2, D)
    with torch.no_grad():
        out, _ = layer(x)
    torch.testing.assert_close(out.reshape(-1, D), layer.shared_experts(x.reshape(-1, D)))


# Sinkhorn and BASE -------------------------------------------------------------------------

def test_sinkhorn_potentials_balance_the_plan():
    torch.manual_seed(0)
    logits = torch.randn(200, E) * 2 + torch.randn(E) * 3
    log_v = sinkhorn_potentials(logits, tolerance=1e-6, max_iterations=1000)
    columns = [sum(math.exp(float(logits[t, e] + log_v[e])) /
                   sum(math.exp(float(logits[t, j] + log_v[j])) for j in range(E))
                   for t in range(200)) for e in range(E)]
    assert columns == pytest.approx([200 / E] * E, rel=1e-5)


def test_sinkhorn_router_gates_from_plan_and_plain_topk_at_inference():
    router = make_router(cfg(router={"kind": "sinkhorn"}))
    x = torch.randn(50, D)
    logits = logits_of(router, x)
    log_v = sinkhorn_potentials(logits, 1e-4, 100)
    plan = torch.softmax(logits + log_v.float(), -1)
    routing = router(x)
    for t in range(50):
        best = sorted(range(E), key=lambda e: -float(plan[t, e]))[:2]
        assert set(torch.nonzero(routing.selected_TE[t]).flatten().tolist()) == set(best)
        for e in best:
            assert float(routing.gates_TE[t, e]) == pytest.approx(float(plan[t, e]), rel=1e-4)
    router.eval()
    with torch.no_grad():
        routing = router(x)
    probs = torch.softmax(logits, -1)
    for t in range(50):
        best = sorted(range(E), key=lambda e: -float(probs[t, e]))[:2]
        assert set(torch.nonzero(routing.selected_TE[t]).flatten().tolist()) == set(best)


def brute_force_balanced(logits, loads):
    """The best assignment with the given loads, by enumerating every one (tiny sizes)."""
    N = logits.shape[0]
    slots = [e for e, n in enumerate(loads) for _ in range(n)]
    return max(sum(float(logits[t, slots[p[t]]]) for t in range(N))
               for p in itertools.permutations(range(N)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_assignment_is_optimal_with_equal_loads(seed):
    torch.manual_seed(seed)
    logits = torch.randn(7, 3) * 2
    expert, _ = balanced_assignment(logits, relative_eps=1e-6)
    assert torch.bincount(expert, minlength=3).tolist() == [3, 2, 2]
    got = sum(float(logits[t, expert[t]]) for t in range(7))
    assert got == pytest.approx(brute_force_balanced(logits, [3, 2, 2]), abs=1e-4)


def test_balanced_assignment_near_optimal_at_scale():
    scipy_optimize = pytest.importorskip("scipy.optimize")
    torch.manual_seed(0)
    logits = (torch.randn(400, E) * 2 + torch.randn(E) * 3).double()
    expert, _ = balanced_assignment(logits)
    assert torch.bincount(expert, minlength=E).tolist() == [50] * E
    slots = torch.arange(E).repeat_interleave(50)
    rows, cols = scipy_optimize.linear_sum_assignment(-logits[:, slots].numpy())
    best = float(logits[torch.as_tensor(rows), slots[torch.as_tensor(cols)]].sum())
    spread = float(logits.max() - logits.min())
    got = float(logits[torch.arange(400), expert].sum())
    assert best - 400 * 1e-3 * spread <= got <= best + 1e-9


def test_base_layer_output_form_and_greedy_inference():
    layer = MoELayer(cfg(router={"kind": "base"}, topk=1))
    x = torch.randn(16, 1, D)
    logits = logits_of(layer.router, x.reshape(-1, D))
    expert, _ = balanced_assignment(logits)
    out, _ = layer(x)
    fc1, fc2 = layer.experts.fc1_weight.detach(), layer.experts.fc2_weight.detach()
    for mode_expert, y in [(expert, out)]:
        for t in range(16):
            e, h = int(mode_expert[t]), x[t, 0]
            gate = torch.sigmoid(logits[t, e])
            want = gate * naive_expert(h, fc1[e], fc2[e], "swiglu") + (1 - gate) * h
            torch.testing.assert_close(y[t, 0].detach(), want, rtol=1e-4, atol=1e-5)
    layer.eval()
    with torch.no_grad():
        routing = layer.router(x.reshape(-1, D))
    assert routing.selected_TE.float().argmax(1).tolist() == logits.argmax(1).tolist()


@pytest.mark.parametrize("kind", ["sinkhorn", "base"])
@pytest.mark.parametrize("ep", [2, 4])
def test_balanced_routers_same_at_ep1_and_mock_epN(kind, ep):
    """The assignment is solved over the whole group: EP=N on N shards equals one process on
    all the tokens (outputs, and gradients summed over ranks)."""
    extra = dict(topk=1) if kind == "base" else {}
    torch.manual_seed(0)
    layer = MoELayer(cfg(router={"kind": kind}, **extra))
    torch.manual_seed(1)
    x = torch.randn(ep, 5, 2, D)
    grad_out = torch.randn(ep, 5, 2, D)
    whole = x.reshape(ep * 10, 1, D).clone().requires_grad_()
    out, _ = layer(whole)
    (out * grad_out.reshape(ep * 10, 1, D)).sum().backward()
    ref = {n: p.grad for n, p in layer.named_parameters()}

    def rank(comm):
        replica = expert_parallel_replica(layer, comm)
        xr = x[comm.rank].reshape(10, 1, D).clone().requires_grad_()
        y, _ = replica(xr)
        (y * grad_out[comm.rank].reshape(10, 1, D)).sum().backward()
        return y.detach(), {n: p.grad for n, p in replica.named_parameters()}

    results = run_ranks(ep, rank)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), out.detach(),
                               rtol=1e-5, atol=1e-6)
    for name, expected in ref.items():
        grads = [r[1][name] for r in results]
        got = torch.cat(grads) if name.startswith("experts.") else sum(grads)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


# Skywork-MoE --------------------------------------------------------------------------------

def test_gate_logit_normalisation_formula():
    router = make_router(cfg(router={"gate_logit_norm": 2.0}))
    x = torch.randn(10, D)
    logits = logits_of(router, x)
    with torch.no_grad():
        routing = router(x)
    for t in range(10):
        row = logits[t].tolist()
        mean = sum(row) / E
        std = math.sqrt(sum((v - mean) ** 2 for v in row) / (E - 1))
        want = [2.0 * (v - mean) / std for v in row]
        assert routing.logits_TE[t].tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_adaptive_coefficient_follows_the_drop_rate(capacity_factor):
    layer = MoELayer(cfg(balancing={"methods": "adaptive_aux_loss", "aux_loss_coeff": 0.05,
                                    "adaptive_aux_decay": 0.8, "adaptive_aux_sensitivity": 0.3},
                         dispatcher={"capacity_factor": capacity_factor}))
    alpha = 0.05
    torch.manual_seed(2)
    for _ in range(3):
        x = torch.randn(12, 2, D) + 0.5
        layer(x)[0].sum().backward()
        stats = layer.router.load.stats
        selected, routed = stats.selected_E.tolist(), stats.routed_E.tolist()
        if capacity_factor is None:
            mean = sum(selected) / E
            rate = sum(max(c - mean, 0.0) for c in selected) / sum(selected)
        else:
            rate = 1 - sum(routed) / sum(selected)
        metrics = step_balancing(layer)
        alpha = 0.8 * alpha + 0.2 * 0.3 * rate
        assert float(layer.router.adaptive_aux_coeff) == pytest.approx(alpha, rel=1e-5)
        assert metrics["moe/layer0/adaptive_drop_rate"] == pytest.approx(rate, rel=1e-5)
    assert "adaptive_aux_coeff" in layer.router.state_dict()


def test_adaptive_coefficient_weights_the_switch_loss_gradient():
    """The router gradient of the adaptive loss is alpha times that of the plain Switch loss."""
    grads = {}
    for kind, coeff in [("aux_loss", 1.0), ("adaptive_aux_loss", 1.0)]:
        torch.manual_seed(0)
        layer = MoELayer(cfg(balancing={"methods": kind, "aux_loss_coeff": coeff}))
        if kind == "adaptive_aux_loss":
            layer.router.adaptive_aux_coeff.fill_(0.25)
        torch.manual_seed(1)
        out, _ = layer(torch.randn(6, 2, D))
        out.sum().backward()
        with torch.no_grad():
            grads[kind] = layer.router.weight.grad.clone()
    torch.manual_seed(0)
    plain = MoELayer(cfg())
    torch.manual_seed(1)
    plain(torch.randn(6, 2, D))[0].sum().backward()
    task = plain.router.weight.grad
    torch.testing.assert_close(grads["adaptive_aux_loss"] - task,
                               0.25 * (grads["aux_loss"] - task), rtol=1e-4, atol=1e-7)


# ERC loss -------------------------------------------------------------------------------------

def naive_erc(router_ED, fc1_EFD, margin):
    n = router_ED.shape[0]
    M = [[float((fc1_EFD[j] @ router_ED[i]).norm()) for j in range(n)] for i in range(n)]
    total = 0.0
    for i in range(n):
        for j in range(n):
            if i != j:
                total += max(M[i][j] - margin * M[i][i], 0) + max(M[j][i] - margin * M[i][i], 0)
    return total / (n * (n - 1))


def test_erc_loss_matches_naive_and_is_independent_of_batch():
    layer = MoELayer(cfg(balancing={"erc_loss_coeff": 1.0, "erc_noise": 0.0, "erc_margin": 0.7}))
    losses = [layer.balance_losses(layer.router(torch.randn(T, D)), T, 1)["erc_loss"]
              for T in (4, 64)]
    want = naive_erc(layer.router.weight.detach(), layer.experts.fc1_weight.detach(), 0.7)
    assert [float(v) for v in losses] == pytest.approx([want, want], rel=1e-5)


def test_erc_noise_is_multiplicative_and_bounded():
    torch.manual_seed(0)
    layer = MoELayer(cfg(balancing={"erc_loss_coeff": 1.0, "erc_noise": 0.2, "erc_margin": 1.0}))
    values = [float(layer.balance_losses(layer.router(torch.randn(4, D)), 4, 1)["erc_loss"])
              for _ in range(4)]
    assert len(set(values)) > 1  # a fresh perturbation each forward


@pytest.mark.parametrize("ep", [2, 4])
def test_erc_loss_and_gradients_same_at_ep1_and_mock_epN(ep):
    """Each rank's loss equals the EP=1 loss; gradients summed over ranks equal the EP=1
    gradient summed over the same data-parallel ranks."""
    torch.manual_seed(0)
    layer = MoELayer(cfg(balancing={"erc_loss_coeff": 1.0, "erc_noise": 0.0}))
    want = naive_erc(layer.router.weight.detach(), layer.experts.fc1_weight.detach(), 0.5)
    from megamoe.balancing.erc import erc_loss
    single = erc_loss(layer.router.weight, layer.experts.fc1_weight, 0.0, 0.5,
                      layer.ep_comm)
    single.backward()
    ref_router, ref_fc1 = layer.router.weight.grad.clone(), layer.experts.fc1_weight.grad.clone()

    def rank(comm):
        replica = expert_parallel_replica(layer, comm)
        loss = erc_loss(replica.router.weight, replica.experts.fc1_weight, 0.0, 0.5, comm)
        loss.backward()
        return float(loss), replica.router.weight.grad, replica.experts.fc1_weight.grad

    results = run_ranks(ep, rank)
    assert [r[0] for r in results] == pytest.approx([want] * ep, rel=1e-5)
    torch.testing.assert_close(sum(r[1] for r in results), ep * ref_router, rtol=1e-4,
                               atol=1e-7)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), ep * ref_fc1, rtol=1e-4,
                               atol=1e-7)


# Configuration --------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, word", [
    (dict(router={"kind": "threshold", "score_function": "softmax"}), "sigmoid"),
    (dict(router={"kind": "base"}, topk=2), "topk=2"),
    (dict(router={"kind": "sinkhorn", "score_function": "sigmoid"}), "softmax"),
    (dict(router={"kind": "sinkhorn"}, balancing={"methods": "bias"}), "bias"),
    (dict(router={"kind": "threshold", "capacity": 1.5}), "router.capacity"),
    (dict(router={"gate_logit_norm": 0.0}), "router.gate_logit_norm"),
    (dict(balancing={"erc_noise": 1.0}), "balancing.erc_noise"),
])
def test_bad_settings_name_the_value(changes, word):
    with pytest.raises(ConfigError, match=word):
        cfg(**changes)


def test_evaluation_needs_a_valid_split():
    from pathlib import Path

    from megamoe.train.config import load_config

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="data.split=95,5,0"):
        load_config(tiny, ["evaluation.interval=5"])
    assert load_config(tiny, ["evaluation.interval=5", "data.split=95,5,0"]).evaluation.batches == 4
