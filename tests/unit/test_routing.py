"""Routers against naive per-token references."""
import pytest
import torch

from megamoe import MoEConfig
from megamoe.routing import ROUTERS
from megamoe.settings import deep_merge

from reference import naive_top_p, naive_topk

T, D, E = 64, 16, 8


def make_router(**changes):
    """The router of the tiny config with nested `changes` (e.g. router={"kind": "top_p"})."""
    torch.manual_seed(0)
    cfg = MoEConfig.from_dict(deep_merge(dict(hidden_size=D, num_experts=E, ffn_hidden_size=32),
                                         changes))
    return ROUTERS[cfg.router.kind](cfg)


def chosen_sets(selected_TE):
    return [set(torch.nonzero(row).flatten().tolist()) for row in selected_TE]


# Each score function written out (sqrtsoftplus: DeepSeek-V4's sqrt(log(1 + e^x))).
SCORES = {"softmax": lambda logits: logits.softmax(-1),
          "sigmoid": lambda logits: 1 / (1 + torch.exp(-logits)),
          "sqrtsoftplus": lambda logits: torch.log1p(torch.exp(logits)).sqrt()}


@pytest.mark.parametrize("score_function, pre_softmax", [
    ("softmax", False), ("softmax", True), ("sigmoid", False), ("sqrtsoftplus", False)])
@pytest.mark.parametrize("scaling", [None, 2.5])
def test_topk_matches_naive(score_function, pre_softmax, scaling):
    router = make_router(topk=2, router={"score_function": score_function,
                                         "pre_softmax": pre_softmax,
                                         "topk_scaling_factor": scaling})
    x = torch.randn(T, D)
    with torch.no_grad():
        routing = router(x)
    logits = x @ router.weight.detach().t()
    scores = SCORES[score_function](logits)
    expected = naive_topk(scores, 2)
    assert chosen_sets(routing.selected_TE) == [set(c) for c in expected]
    for t, experts in enumerate(expected):
        raw = [float(scores[t, e]) for e in experts]
        if not pre_softmax:  # softmax after selection, or per-expert scores normalised
            raw = [r / sum(raw) for r in raw]
        want = [r * (scaling or 1.0) for r in raw]
        got = [float(routing.gates_TE[t, e]) for e in experts]
        assert got == pytest.approx(want, rel=1e-5)
    assert float(routing.gates_TE[~routing.selected_TE].abs().sum()) == 0.0


@pytest.mark.parametrize("topk, group_score_topk", [(4, None), (3, 2), (2, 1)])
def test_group_limited_topk_matches_naive(topk, group_score_topk):
    """Groups scored by topk / groups_per_token experts (Megatron-Core's rule), or by
    group_score_topk (DeepSeek-V3's 2 whatever the top-k; a top-k not a multiple of it)."""
    router = make_router(topk=topk, router={"num_groups": 4, "groups_per_token": 2,
                                            "score_function": "sigmoid",
                                            "group_score_topk": group_score_topk})
    x = torch.randn(T, D)
    routing = router(x)
    scores = (x @ router.weight.detach().t()).sigmoid()
    expected = naive_topk(scores, topk, num_groups=4, groups_per_token=2,
                          group_score_topk=group_score_topk)
    assert chosen_sets(routing.selected_TE) == [set(c) for c in expected]
    groups_used = [{e // 2 for e in c} for c in chosen_sets(routing.selected_TE)]
    assert all(len(g) <= 2 for g in groups_used)


def test_bias_steers_selection_only():
    router = make_router(topk=2, balancing={"methods": "bias"},
                         router={"score_function": "sigmoid"})
    bias = torch.linspace(-0.5, 0.5, E)
    router.expert_bias.copy_(bias)
    x = torch.randn(T, D)
    routing = router(x)
    scores = (x @ router.weight.detach().t()).sigmoid()
    expected = naive_topk(scores, 2, bias=bias)
    assert chosen_sets(routing.selected_TE) == [set(c) for c in expected]
    for t, experts in enumerate(expected):  # gates: unbiased scores, renormalised
        raw = [float(scores[t, e]) for e in experts]
        got = [float(routing.gates_TE[t, e]) for e in experts]
        assert got == pytest.approx([r / sum(raw) for r in raw], rel=1e-5)


def test_bias_gets_no_gradient_and_is_not_a_parameter():
    router = make_router(topk=2, balancing={"methods": "bias"},
                         router={"score_function": "softmax"})
    router.expert_bias.fill_(0.1)
    routing = router(torch.randn(T, D))
    (routing.gates_TE.sum() + routing.probs_TE.square().sum()).backward()
    assert "expert_bias" not in dict(router.named_parameters())
    assert not router.expert_bias.requires_grad and router.expert_bias.grad is None
    assert router.weight.grad is not None


@pytest.mark.parametrize("p", [0.2, 0.4, 0.7, 1.0])
def test_top_p_crossing_rule_matches_naive(p):
    router = make_router(router={"kind": "top_p", "threshold": p})
    x = torch.randn(T, D) * 3
    routing = router(x)
    probs = (x @ router.weight.detach().t()).softmax(-1)
    expected = naive_top_p(probs.double(), p)
    got = chosen_sets(routing.selected_TE)
    assert got == [set(c) for c in expected]
    assert all(len(c) >= 1 for c in got)
    # gates are the raw probabilities, not renormalised
    torch.testing.assert_close(routing.gates_TE, probs * routing.selected_TE)


def test_top_p_number_of_experts_varies():
    router = make_router(router={"kind": "top_p", "threshold": 0.5})
    with torch.no_grad():
        router.weight.mul_(50)
    counts = router(torch.randn(256, D)).selected_TE.sum(1)
    assert counts.min() < counts.max()
