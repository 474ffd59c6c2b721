"""Upcycling methods as pure tensor functions, against plain formulas and a per-token MoE loop."""
import math

import pytest
import torch
import torch.nn.functional as F

from megamoe.errors import ConfigError
from megamoe.upcycle.drop import add_noise, drop_upcycle
from megamoe.upcycle.experts import LayerUpcycler
from megamoe.upcycle.granular import (MLPWeights, apply_factors, dense_mlp, init_router,
                                      output_scale, scale_factors, shard)
from megamoe.upcycle.recipe import UpcycleRecipe, parse_moe_layers

H, FFN = 16, 24


def mlp_reference(fc1, fc2, x, activation):
    """y = fc2 act(fc1 x), GLU: act = silu(gate) * up with fc1 = [gate; up]."""
    h = x @ fc1.t()
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    elif activation == "gelu":
        h = F.gelu(h)
    elif activation == "squared_relu":
        h = F.relu(h) ** 2
    else:
        h = F.relu(h)
    return h @ fc2.t()


def moe_reference(x, router, experts, topk, activation, pre_softmax=False, sigmoid=False):
    """Per-token loop: top-k by score, gates renormalised over the chosen (softmax after
    selection, sigmoid) or raw softmax probabilities (softmax before selection)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = [float(router[e] @ x[t]) for e in range(len(experts))]
        if sigmoid:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        else:
            total = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / total for v in logits]
        chosen = sorted(range(len(experts)), key=lambda e: -scores[e])[:topk]
        mass = 1.0 if pre_softmax else sum(scores[e] for e in chosen)
        for e in chosen:
            out[t] += scores[e] / mass * mlp_reference(experts[e].fc1, experts[e].fc2, x[t:t + 1],
                                                       activation)[0]
    return out


def random_mlp(gated, seed=0, mean=0.0, std=0.3):
    g = torch.Generator().manual_seed(seed)
    fc1 = torch.randn(FFN * (2 if gated else 1), H, generator=g) * std + mean
    fc2 = torch.randn(H, FFN, generator=g) * std + mean
    return dense_mlp(fc1, fc2)


def tokens(n=12, seed=1):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("granularity", [1, 2, 3, 4])
def test_shards_partition_the_dense_mlp(gated, granularity):
    mlp, x = random_mlp(gated), tokens()
    activation = "swiglu" if gated else "gelu"
    shards = [shard(mlp, g, granularity) for g in range(granularity)]
    total = sum(mlp_reference(s.fc1, s.fc2, x, activation) for s in shards)
    torch.testing.assert_close(total, mlp_reference(mlp.fc1, mlp.fc2, x, activation))
    size = FFN // granularity
    last = shards[-1]
    assert last.fc2.shape == (H, size)
    if gated:  # gate and up halves are split separately
        torch.testing.assert_close(last.fc1[:size], mlp.fc1[FFN - size:FFN])
        torch.testing.assert_close(last.fc1[size:], mlp.fc1[2 * FFN - size:])


def test_virtual_group_router_repeats_each_row_for_its_group():
    weight = init_router("virtual_group", 8, 2, H, 0.02, torch.Generator().manual_seed(0))
    assert weight.shape == (8, H)
    for a in range(8):
        for b in range(8):
            assert torch.equal(weight[a], weight[b]) == (a // 2 == b // 2)
    random_rows = init_router("random", 8, 2, H, 0.02, torch.Generator().manual_seed(0))
    assert len({tuple(row.tolist()) for row in random_rows}) == 8
    assert not init_router("zero", 8, 2, H, 0.02, torch.Generator()).any()


def test_output_scale_follows_the_paper():
    assert output_scale(8, 2, 2, "softmax", pre_softmax=False) == 2  # G
    assert output_scale(8, 2, 2, "softmax", pre_softmax=True) == 8 * 2 / 2  # E*G/K
    assert output_scale(8, 4, 1, "sigmoid", pre_softmax=False) == 1
    assert output_scale(8, 1, 1, "sigmoid", pre_softmax=False) == 2


@pytest.mark.parametrize("rule,activation,gated", [
    ("exact", "swiglu", True), ("exact", "gelu", False), ("exact", "squared_relu", False),
    ("paper", "squared_relu", False), ("paper", "relu", False)])
def test_scale_factors_scale_the_output_exactly(rule, activation, gated):
    mlp, x = random_mlp(gated), tokens()
    scaled = apply_factors(mlp, scale_factors(3.0, gated, activation, rule))
    torch.testing.assert_close(mlp_reference(scaled.fc1, scaled.fc2, x, activation),
                               3.0 * mlp_reference(mlp.fc1, mlp.fc2, x, activation))


def test_paper_rule_uses_cube_roots_for_glu_and_square_roots_otherwise():
    glu = scale_factors(8.0, True, "swiglu", "paper")
    assert (glu.gate, glu.up, glu.fc2) == pytest.approx((2.0, 2.0, 2.0))
    squared = scale_factors(8.0, False, "squared_relu", "paper")
    assert (squared.gate, squared.up, squared.fc2) == pytest.approx((1.0, 2.0, 2.0))
    plain = scale_factors(4.0, False, "gelu", "paper")
    assert (plain.gate, plain.up, plain.fc2) == pytest.approx((1.0, 2.0, 2.0))


def upcycled(recipe, mlp, activation):
    upcycler = LayerUpcycler(recipe, mlp, layer=3, activation=activation)
    experts = [upcycler.expert(e) for e in range(recipe.num_experts)]
    return upcycler, experts


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("experts,granularity,topk", [(4, 1, 1), (4, 1, 2), (8, 2, 2),
                                                      (8, 2, 4), (8, 4, 4), (6, 3, 3)])
@pytest.mark.parametrize("shared", [False, True])
def test_upcycled_layer_computes_the_dense_function(gated, experts, granularity, topk, shared):
    activation = "swiglu" if gated else "gelu"
    mlp, x = random_mlp(gated), tokens()
    recipe = UpcycleRecipe(num_experts=experts, topk=topk, granularity=granularity,
                           shared_expert=shared, router_init_std=0.5)
    upcycler, routed = upcycled(recipe, mlp, activation)
    out = moe_reference(x, upcycler.router_weight(), routed, topk, activation)
    if shared:
        shared_mlp = upcycler.shared_expert()
        out = out + mlp_reference(shared_mlp.fc1, shared_mlp.fc2, x, activation)
    torch.testing.assert_close(out, mlp_reference(mlp.fc1, mlp.fc2, x, activation),
                               atol=1e-5, rtol=1e-4)
    assert recipe.function_preserving(gated, activation) == (True, "")


def test_sigmoid_router_with_renormalised_gates_is_preserved():
    mlp, x = random_mlp(True), tokens()
    recipe = UpcycleRecipe(num_experts=8, topk=4, granularity=2, score_function="sigmoid",
                           router_init_std=0.5)
    upcycler, routed = upcycled(recipe, mlp, "swiglu")
    out = moe_reference(x, upcycler.router_weight(), routed, 4, "swiglu", sigmoid=True)
    torch.testing.assert_close(out, mlp_reference(mlp.fc1, mlp.fc2, x, "swiglu"),
                               atol=1e-5, rtol=1e-4)


def test_softmax_before_selection_is_scaled_by_e_g_over_k():
    """With a uniform (zero) router every chosen expert gets 1/E: the E/K scale restores it."""
    mlp, x = random_mlp(True), tokens()
    dense = mlp_reference(mlp.fc1, mlp.fc2, x, "swiglu")
    for scaling, matches in (("exact", True), ("none", False)):
        recipe = UpcycleRecipe(num_experts=4, topk=2, pre_softmax=True, router_init="zero",
                               weight_scaling=scaling)
        upcycler, routed = upcycled(recipe, mlp, "swiglu")
        out = moe_reference(x, upcycler.router_weight(), routed, 2, "swiglu", pre_softmax=True)
        assert torch.allclose(out, dense, atol=1e-5, rtol=1e-4) == matches


def test_topk_not_a_multiple_of_granularity_breaks_the_dense_function():
    mlp, x = random_mlp(True), tokens()
    recipe = UpcycleRecipe(num_experts=8, topk=3, granularity=2, router_init_std=0.5)
    upcycler, routed = upcycled(recipe, mlp, "swiglu")
    out = moe_reference(x, upcycler.router_weight(), routed, 3, "swiglu")
    assert not torch.allclose(out, mlp_reference(mlp.fc1, mlp.fc2, x, "swiglu"), atol=1e-3)
    assert recipe.function_preserving(True, "swiglu")[0] is False


def changed_neurons(expert: MLPWeights, source: MLPWeights) -> list[set[int]]:
    """Per matrix (gate, up, fc2): the intermediate neurons whose weights differ."""
    matrices = [(expert.gate, source.gate, 1), (expert.up, source.up, 1),
                (expert.fc2, source.fc2, 0)]
    return [set(torch.nonzero((a != b).any(dim=dim)).flatten().tolist())
            for a, b, dim in matrices]


def test_drop_upcycling_reinitialises_a_fraction_per_expert_with_matching_statistics():
    ffn, hidden = 400, 64
    g = torch.Generator().manual_seed(5)
    mean, std = 0.5, 2.0
    mlp = dense_mlp(torch.randn(2 * ffn, hidden, generator=g) * std + mean,
                    torch.randn(hidden, ffn, generator=g) * std + mean)
    recipe = UpcycleRecipe(num_experts=4, topk=2, drop_ratio=0.3)
    upcycler = LayerUpcycler(recipe, mlp, layer=0, activation="swiglu")
    subsets = []
    for e in range(4):
        expert = upcycler.expert(e)
        gate, up, down = changed_neurons(expert, mlp)
        assert gate == up == down and len(gate) == round(0.3 * ffn)
        subsets.append(gate)
        index = torch.tensor(sorted(gate))
        fresh = torch.cat([expert.gate[index].flatten(), expert.up[index].flatten(),
                           expert.fc2[:, index].flatten()])
        assert abs(float(fresh.mean()) - mean) < 0.05
        assert abs(float(fresh.std()) / std - 1) < 0.03
        keep = torch.tensor(sorted(set(range(ffn)) - gate))
        assert torch.equal(expert.up[keep], mlp.up[keep])
    assert len({frozenset(s) for s in subsets}) == 4  # a different subset per expert


def test_drop_upcycling_of_a_plain_mlp_and_noise():
    mlp = random_mlp(False, std=1.0)
    dropped = drop_upcycle(mlp, 0.5, torch.Generator().manual_seed(0))
    _, up, down = changed_neurons(dropped, MLPWeights(mlp.fc1, mlp.fc2, False))
    assert up == down and len(up) == FFN // 2
    noisy = add_noise(mlp, 0.1, torch.Generator().manual_seed(0))
    ratio = float((noisy.fc1 - mlp.fc1).std() / mlp.fc1.std())
    assert 0.07 < ratio < 0.13


def test_experts_are_reproducible_and_independent_of_build_order():
    mlp = random_mlp(True)
    recipe = UpcycleRecipe(num_experts=4, topk=2, drop_ratio=0.5, noise_std=0.01, seed=3)
    first = LayerUpcycler(recipe, mlp, 2, "swiglu")
    second = LayerUpcycler(recipe, mlp, 2, "swiglu")
    late = first.expert(3)
    early = [second.expert(e) for e in range(4)]
    assert torch.equal(late.fc1, early[3].fc1) and torch.equal(late.fc2, early[3].fc2)
    assert not torch.equal(early[0].fc1, early[1].fc1)
    other_layer = LayerUpcycler(recipe, mlp, 5, "swiglu").expert(3)
    assert not torch.equal(other_layer.fc1, late.fc1)
    assert torch.equal(first.router_weight(), second.router_weight())


@pytest.mark.parametrize("changes,match", [
    (dict(num_experts=6, granularity=4), "divisible by granularity"),
    (dict(topk=9), "exceeds num_experts"),
    (dict(drop_ratio=1.5), "drop_ratio"),
    (dict(router_init_std=float("nan")), "router_init_std=nan must be a finite number >= 0"),
    (dict(noise_std=float("inf")), "noise_std=inf must be a finite number >= 0"),
    (dict(noise_std=-0.1), "noise_std=-0.1 must be a finite number >= 0"),
    (dict(pre_softmax=True, score_function="sigmoid"), "pre_softmax"),
    (dict(moe_layers=(1, 3), key_layout="stacked"), "stacked"),
    (dict(moe_layers=0), "positive"),
    (dict(router_init="orthogonal"), "router_init"),
])
def test_recipe_rejects_bad_values(changes, match):
    with pytest.raises(ConfigError, match=match):
        UpcycleRecipe(**{"num_experts": 8, "topk": 2, **changes})


def test_layer_selection_matches_megatron_moe_layer_freq():
    every2 = UpcycleRecipe(num_experts=4, topk=2, moe_layers=parse_moe_layers("every:2"))
    assert every2.layer_pattern(5) == [True, False, True, False, True]
    assert every2.moe_layer_freq(5) == 2 and every2.resolved_key_layout() == "per_layer"
    listed = UpcycleRecipe(num_experts=4, topk=2, moe_layers=parse_moe_layers("3,1"))
    assert listed.layer_pattern(4) == [False, True, False, True]
    assert listed.moe_layer_freq(4) == [0, 1, 0, 1]
    everything = UpcycleRecipe(num_experts=4, topk=2)
    assert everything.layer_pattern(3) == [True] * 3 and everything.moe_layer_freq(3) == 1
    assert everything.resolved_key_layout() == "stacked"
    with pytest.raises(ConfigError, match="outside"):
        listed.layer_pattern(3)
    with pytest.raises(ConfigError, match="every:N"):
        parse_moe_layers("odd")
