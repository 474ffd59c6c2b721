"""Granular upcycling preserves the dense function only with the virtual-group router init."""
import pytest
import torch

from megamoe.upcycle.recipe import UpcycleRecipe
from test_upcycle_methods import mlp_reference, moe_reference, random_mlp, tokens, upcycled


@pytest.mark.parametrize("router_init", ["random", "zero", "virtual_group"])
def test_granular_function_preserving_flag_matches_the_model(router_init):
    mlp, x = random_mlp(True), tokens()
    recipe = UpcycleRecipe(num_experts=8, topk=4, granularity=2, router_init=router_init,
                           router_init_std=0.5)
    upcycler, routed = upcycled(recipe, mlp, "swiglu")
    out = moe_reference(x, upcycler.router_weight(), routed, 4, "swiglu")
    dense = mlp_reference(mlp.fc1, mlp.fc2, x, "swiglu")
    exact = torch.allclose(out, dense, atol=1e-5, rtol=1e-4)
    preserving, reason = recipe.function_preserving(True, "swiglu")
    if router_init == "random":
        assert not exact  # the shards of one copy are picked independently
    if router_init == "virtual_group":
        assert exact
    assert preserving is (router_init == "virtual_group")
    assert preserving or "router_init" in reason
