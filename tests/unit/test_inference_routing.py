"""Routing at inference: the eval-mode tally against a naive top-p loop, and the held-out routing
metrics against plain Python statistics."""
import math
import statistics

import torch

from megamoe import BalancingConfig, MoEConfig, TopPRouterConfig
from megamoe.balancing.inference import tallying_inference_routing
from megamoe.layer import MoELayer
from megamoe.train.evaluate import routing_metrics

from reference import naive_top_p

D, E = 16, 8


def top_p_layer() -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=D, num_experts=E, ffn_hidden_size=24,
                               router=TopPRouterConfig(threshold=0.5),
                               balancing=BalancingConfig(methods="aux_loss")))
    with torch.no_grad():  # a confident router: the number of experts differs between tokens
        layer.router.weight.normal_(0.0, 0.5)
    return layer


def test_eval_forwards_are_tallied_per_token_in_batch_sequence_order():
    layer = top_p_layer()
    S, B = 7, 3
    x_SBD = torch.randn(S, B, D)
    with tallying_inference_routing(layer) as tallies:
        layer.train()
        layer(x_SBD)  # a training forward is not an inference one
        layer.eval()
        with torch.no_grad():
            layer(x_SBD)
        (tally,) = tallies.values()
    assert layer.router.inference_tally is None  # off after the block
    assert len(tally.counts_BS) == 1
    probs = (x_SBD.reshape(-1, D) @ layer.router.weight.detach().t()).double().softmax(-1)
    chosen = naive_top_p(probs, 0.5)  # token t = s * B + b
    expected = [[len(chosen[s * B + b]) for s in range(S)] for b in range(B)]
    assert tally.counts_BS[0].tolist() == expected
    assert len({n for row in expected for n in row}) > 1  # the count does vary


def test_eval_forward_outside_the_block_records_nothing():
    layer = top_p_layer().eval()
    with torch.no_grad():
        layer(torch.randn(4, 2, D))
    assert layer.router.inference_tally is None
    assert layer.router.load.empty


class _Tally:
    def __init__(self, counts_BS, num_experts=3):
        self.counts_BS, self.num_experts = counts_BS, num_experts


def test_routing_metrics_match_plain_statistics():
    generator = torch.Generator().manual_seed(1)
    counts = [torch.randint(1, 4, (2, 5), generator=generator).float() for _ in range(3)]
    losses = [torch.rand(2, 5, generator=generator) * 4 for _ in range(3)]
    masks = [torch.ones(2, 5) for _ in range(3)]
    masks[1][0, :2] = 0  # masked tokens count for experts/token, not for the loss pairing
    metrics = routing_metrics({2: _Tally(counts)}, torch.stack(losses), torch.stack(masks))

    xs, ys = [], []
    for c, l, m in zip(counts, losses, masks):
        for x, y, keep in zip(c.flatten().tolist(), l.flatten().tolist(), m.flatten().tolist()):
            if keep:
                xs.append(x)
                ys.append(y)
    all_counts = [x for c in counts for x in c.flatten().tolist()]
    assert math.isclose(metrics["heldout/layer2/experts_per_token"],
                        statistics.fmean(all_counts), rel_tol=1e-6)
    by_k = {k: [y for x, y in zip(xs, ys) if x == k] for k in range(4)}
    assert metrics["heldout/layer2/tokens_by_experts"] == \
        [len(by_k[k]) / len(xs) for k in range(4)]
    assert metrics["heldout/layer2/loss_by_experts"][0] is None
    for k in range(1, 4):
        assert math.isclose(metrics["heldout/layer2/loss_by_experts"][k],
                            statistics.fmean(by_k[k]), rel_tol=1e-6)
    assert math.isclose(metrics["heldout/layer2/loss_experts_corr"],
                        statistics.correlation(xs, ys), rel_tol=1e-6)


def test_constant_experts_per_token_has_no_correlation():
    counts = [torch.full((2, 4), 2.0)]
    metrics = routing_metrics({1: _Tally(counts)}, torch.rand(1, 2, 4), torch.ones(1, 2, 4))
    assert metrics["heldout/layer1/experts_per_token"] == 2.0
    assert metrics["heldout/layer1/loss_experts_corr"] is None


def test_split_sequences_report_experts_per_token_only():
    """A router that saw a sequence-parallel shard cannot pair its tokens with the losses."""
    counts = [torch.full((2, 2), 1.0)]
    metrics = routing_metrics({1: _Tally(counts)}, torch.rand(1, 2, 4), torch.ones(1, 2, 4))
    assert metrics == {"heldout/layer1/experts_per_token": 1.0}
