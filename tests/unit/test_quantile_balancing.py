"""Quantile balancing against a reference written from its derivation (one sweep of dual
coordinate descent per micro-batch, with sorted Python lists), on one rank, over data-parallel
replicas and over a tensor-parallel token group (mock ranks), and its refusals."""
import pytest
import torch

from megamoe import ConfigError, MoEConfig
from megamoe.balancing import step_balancing
from megamoe.layer import MoELayer
from mock_ranks import run_ranks

E, D, K, S, B = 8, 16, 2, 8, 3
STEPS, MICRO = 5, 2


def quantile_layer(ema: float, score: str = "softmax") -> MoELayer:
    cfg = MoEConfig.from_dict({"hidden_size": D, "num_experts": E, "ffn_hidden_size": 8,
                               "topk": K, "router": {"score_function": score},
                               "balancing": {"methods": "quantile", "quantile_ema": ema}})
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    with torch.no_grad():  # logits of order 1, so the bias matters
        layer.router.weight.copy_(torch.randn(E, D, generator=torch.Generator().manual_seed(1)))
    return layer


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    seed = 100 * rank + 10 * step + micro
    return torch.randn(S, B, D, generator=torch.Generator().manual_seed(seed))


def reference_choice(logits, beta):
    """Per token: (the k experts with the largest logit - beta, its cutoff alpha: the (k+1)-th
    largest)."""
    chosen, cutoffs = [], []
    for row in logits.tolist():
        ranked = sorted(range(E), key=lambda j: row[j] - beta[j], reverse=True)
        chosen.append(set(ranked[:K]))
        cutoffs.append(row[ranked[K]] - beta[ranked[K]])
    return chosen, cutoffs


def reference_estimate(logits, cutoffs):
    """Per expert: the (c+1)-th largest logit - alpha over the tokens, c = N k / E."""
    per_expert = len(cutoffs) * K // E
    return [sorted((row[j] - a for row, a in zip(logits.tolist(), cutoffs)),
                   reverse=True)[per_expert] for j in range(E)]


def reference_update(beta, estimates, ema):
    """Estimates averaged (micro-batches, then replicas), blended, centred."""
    mean = [sum(column) / len(estimates) for column in zip(*estimates)]
    blended = [ema * b + (1 - ema) * m for b, m in zip(beta, mean)]
    centre = sum(blended) / E
    return [value - centre for value in blended]


def routed_sets(selected_TE):
    return [set(torch.nonzero(row).flatten().tolist()) for row in selected_TE]


def capture(layer):
    seen = []
    layer.router.register_forward_hook(lambda mod, args, out: seen.append(out))
    return seen


@pytest.mark.parametrize("ema", [0.0, 0.5])
def test_bias_and_routing_follow_the_derivation_on_one_rank(ema):
    layer = quantile_layer(ema)
    seen = capture(layer)
    beta = [0.0] * E
    changed = False
    for step in range(STEPS):
        per_micro = []
        for micro in range(MICRO):
            x = batch(step, micro, 0)
            layer(x)[0].sum().backward()
            logits = x.reshape(-1, D) @ layer.router.weight.detach().t()
            chosen, cutoffs = reference_choice(logits, beta)
            assert routed_sets(seen[-1].selected_TE) == chosen
            per_micro.append(reference_estimate(logits, cutoffs))
        # One replica: the micro-batch mean is the estimate.
        beta = reference_update(beta, [[sum(c) / MICRO for c in zip(*per_micro)]], ema)
        step_balancing(layer)
        torch.testing.assert_close(layer.router.qb_beta, torch.tensor(beta), rtol=0, atol=1e-6)
        changed |= any(abs(b) > 1e-3 for b in beta)
    assert changed


def test_padding_is_left_out_of_the_quantile():
    layer = quantile_layer(0.0)
    x = batch(0, 0, 0)
    padding_BS = torch.zeros(B, S, dtype=torch.bool)
    padding_BS[1, 5:] = True  # tokens (s, b=1) for s >= 5
    layer(x, padding_BS)
    step_balancing(layer)
    real_T = ~padding_BS.t().reshape(-1)
    logits = x.reshape(-1, D)[real_T] @ layer.router.weight.detach().t()
    _, cutoffs = reference_choice(logits, [0.0] * E)
    expected = reference_update([0.0] * E, [reference_estimate(logits, cutoffs)], 0.0)
    torch.testing.assert_close(layer.router.qb_beta, torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("split", ["data", "tensor"])
def test_two_ranks_reach_the_bias_of_the_derivation(split):
    """Data-parallel replicas each estimate from their own tokens and average; tensor-parallel
    ranks split one micro-batch's tokens, and the quantile is taken over all of them."""
    def rank_run(comm):
        layer = quantile_layer(0.5)
        layer.replica_comm = comm
        if split == "tensor":
            layer.token_comm = layer.router.token_comm = comm
        seen = capture(layer)
        for step in range(STEPS):
            for micro in range(MICRO):
                x = batch(step, micro, comm.rank if split == "data" else 0)
                if split == "tensor":  # sequence parallelism: each rank holds S/2 positions
                    x = x.chunk(2, dim=0)[comm.rank]
                layer(x)[0].sum().backward()
            step_balancing(layer, comm)
        return layer.router.weight.detach(), layer.router.qb_beta.clone(), \
            [r.selected_TE for r in seen]

    results = run_ranks(2, rank_run)
    weight = results[0][0]
    beta = [0.0] * E
    forwards = 0
    for step in range(STEPS):
        estimates, chosen_by_rank = [], [[], []]
        for rank in ((0, 1) if split == "data" else (0,)):
            per_micro = []
            for micro in range(MICRO):
                logits = batch(step, micro, rank).reshape(-1, D) @ weight.t()
                chosen, cutoffs = reference_choice(logits, beta)
                per_micro.append(reference_estimate(logits, cutoffs))
                if split == "data":
                    chosen_by_rank[rank].append(chosen)
                else:  # rank r routed the rows of its S/2 positions
                    half = S // 2 * B
                    chosen_by_rank[0].append(chosen[:half])
                    chosen_by_rank[1].append(chosen[half:])
            estimates.append([sum(c) / MICRO for c in zip(*per_micro)])
        for rank in (0, 1):
            for micro in range(MICRO):
                assert routed_sets(results[rank][2][forwards + micro]) == \
                    chosen_by_rank[rank][micro]
        forwards += MICRO
        beta = reference_update(beta, estimates, 0.5)
    for _, final_beta, _ in results:
        torch.testing.assert_close(final_beta, torch.tensor(beta), rtol=0, atol=1e-6)


def test_eval_routes_with_the_bias_and_leaves_it():
    layer = quantile_layer(0.0)
    layer(batch(0, 0, 0))
    step_balancing(layer)
    beta = layer.router.qb_beta.clone()
    layer.eval()
    seen = capture(layer)
    x = batch(1, 0, 0)
    with torch.no_grad():
        layer(x)
    step_balancing(layer)
    assert torch.equal(layer.router.qb_beta, beta)
    logits = x.reshape(-1, D) @ layer.router.weight.detach().t()
    assert routed_sets(seen[-1].selected_TE) == reference_choice(logits, beta.tolist())[0]


def test_the_bias_is_saved_and_restored():
    layer = quantile_layer(0.0)
    layer(batch(0, 0, 0))
    step_balancing(layer)
    restored = quantile_layer(0.0)
    restored.load_state_dict(layer.state_dict())
    assert torch.equal(restored.router.qb_beta, layer.router.qb_beta)
    assert set(layer.router.state_dict()) == {"weight", "qb_beta"}


@pytest.mark.parametrize("tree, match", [
    ({"balancing": {"methods": ["quantile", "aux_loss"]}}, "list 'quantile' alone"),
    ({"balancing": {"methods": ["bias", "quantile"]}}, "list 'quantile' alone"),
    ({"balancing": {"methods": "quantile", "quantile_ema": 1.0}}, "quantile_ema=1.0"),
    ({"balancing": {"methods": "quantile"}, "router": {"num_groups": 4, "groups_per_token": 2}},
     "no group-limited routing"),
    ({"balancing": {"methods": "quantile"}, "topk": E}, "topk < num_experts"),
    ({"balancing": {"methods": "quantile"}, "router": {"kind": "threshold"}}, "router.kind=topk"),
    ({"balancing": {"methods": "quantile"}, "router": {"kind": "sinkhorn"}}, "router.kind=topk"),
])
def test_settings_quantile_balancing_cannot_honour_are_refused_in_one_line(tree, match):
    raw = {"hidden_size": D, "num_experts": E, "ffn_hidden_size": 8, "topk": K, **tree}
    with pytest.raises(ConfigError, match=match) as err:
        MoEConfig.from_dict(raw)
    assert "\n" not in str(err.value)
