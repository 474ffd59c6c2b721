"""One step's balancing over a router's replicas: the per-router statistics
(`StepStatistics`) packed, all-reduced and unpacked; the bias moved once, by its owner, at the
step's scheduled rate. References are computed by hand from the recorded routing."""
import pytest
import torch

from megamoe import MoEConfig
from megamoe.balancing import step_balancing
from megamoe.balancing.owner import StepOwner
from megamoe.layer import MoELayer
from mock_ranks import run_ranks

E, D = 4, 8


def layer(**balancing):
    cfg = MoEConfig.from_dict({"hidden_size": D, "num_experts": E, "ffn_hidden_size": 8,
                               "topk": 2, "router": {"score_function": "sigmoid"},
                               "balancing": {"methods": ["bias", "aux_loss"], **balancing}})
    torch.manual_seed(0)
    return MoELayer(cfg)


def micro_batches(rank):
    """Two micro-batches of hand-made routing per rank: (selected [T, E], routed [T, E])."""
    gen = torch.Generator().manual_seed(rank)
    out = []
    for tokens in (5, 3):
        selected = torch.rand(tokens, E, generator=gen) < 0.5
        routed = selected & (torch.rand(tokens, E, generator=gen) < 0.8)
        out.append((selected, routed))
    return out


def test_statistics_reduce_over_replicas_as_counted_by_hand():
    def rank(comm):
        model = layer()
        for selected, routed in micro_batches(comm.rank):
            model.router.load.record(selected, routed,
                                     losses={"aux_loss": torch.tensor(float(selected.sum()))})
        return step_balancing(model, comm)

    metrics = run_ranks(2, rank)
    assert metrics[0] == metrics[1]
    batches = micro_batches(0) + micro_batches(1)
    counts = [0.0] * E
    per_token = []
    for selected, _ in batches:
        for row in selected.tolist():
            if any(row):
                per_token.append(sum(row))
            for i, chosen in enumerate(row):
                counts[i] += chosen
    routed = sum(float(r.sum()) for _, r in batches)
    mean = sum(counts) / E
    got = metrics[0]
    assert got["moe/layer0/experts_per_token"] == pytest.approx(sum(per_token) / len(per_token))
    assert got["moe/layer0/experts_per_token_max"] == max(per_token)
    assert got["moe/layer0/experts_per_token_min"] == min(per_token)
    assert got["moe/layer0/maxvio_global"] == pytest.approx((max(counts) - mean) / mean)
    assert got["moe/layer0/dropped_fraction"] == pytest.approx(1 - routed / sum(counts))
    assert got["moe/layer0/load"] == pytest.approx([c / sum(counts) for c in counts])
    per_batch = [s.sum(0).tolist() for s, _ in batches]
    assert got["moe/layer0/maxvio_batch"] == pytest.approx(sum(
        (max(c) - sum(c) / E) / (sum(c) / E) for c in per_batch) / len(batches))
    # The loss values' mean over every rank's micro-batches.
    assert got["moe/layer0/aux_loss"] == pytest.approx(
        sum(float(s.sum()) for s, _ in batches) / len(batches))


def record(model, rank=0):
    for selected, routed in micro_batches(rank):
        model.router.load.record(selected, routed)
    return sum(s.sum(0).float() for s, _ in micro_batches(rank))


def test_the_bias_moves_at_the_scheduled_rate_of_the_step():
    model = layer(bias_update_rate=0.1, bias_update_schedule=[[3, 0.0], [5, 0.01]])
    for step, rate in ((2, 0.1), (3, 0.0), (4, 0.0), (5, 0.01), (None, 0.1)):
        before = model.router.expert_bias.clone()
        counts = record(model)
        step_balancing(model, step=step)
        expected = before + rate * torch.sign(counts.mean() - counts)
        assert torch.equal(model.router.expert_bias, expected), step


def test_a_bias_updated_by_finalize_model_grads_is_not_updated_again():
    model = layer(bias_update_rate=0.1)
    model.router.step_owner = StepOwner.FINALIZE_MODEL_GRADS
    record(model)
    metrics = step_balancing(model)
    assert float(model.router.expert_bias.abs().sum()) == 0
    assert metrics["moe/layer0/experts_per_token"] > 0 and model.router.load.empty
