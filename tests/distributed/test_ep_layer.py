"""The MoE layer at EP=N on N gloo processes against EP=1 in one process (both dispatchers)."""
import pytest
import torch

import ep_workers

WORLDS = ["world2", "world4"]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", sorted(ep_workers.LAYER_CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_forward_and_backward_match_ep1(world, case, dispatcher, request):
    for rank, result in enumerate(request.getfixturevalue(world)):
        pairs = result["layers"]["cases"][f"{case}/{dispatcher}"]["pairs"]
        for name, (got, expected) in pairs.items():
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("world", WORLDS)
def test_edge_cases_really_happened(world, request):
    """Preconditions of the cases above: a rank whose experts receive no token, and a rank
    that sends none."""
    for result in request.getfixturevalue(world):
        cases = result["layers"]["cases"]
        assert cases["zero_tokens_to_last_rank/alltoall"]["tokens_to_last_rank"] == 0
        assert 0 in cases["uneven_and_empty_rank/alltoall"]["tokens_per_rank"]


@pytest.mark.parametrize("world", WORLDS)
def test_bias_balancing_identical_on_all_ranks(world, request):
    results = request.getfixturevalue(world)
    for result in results:
        replica_bias, single_process_bias = result["layers"]["bias"]["frozen"]
        assert single_process_bias.abs().sum() > 0
        assert torch.equal(replica_bias, single_process_bias)
    trained = results[0]["layers"]["bias"]
    assert trained["biases"][0].abs().sum() > 0
    for rank in range(len(results)):
        assert torch.equal(trained["biases"][rank], trained["biases"][0]), f"rank {rank}"
        assert torch.equal(trained["router_weights"][rank], trained["router_weights"][0])


def test_expert_tensor_parallelism_is_rejected_clearly(world2):
    messages = world2[0]["rejects"]
    assert messages["expert_tp"].startswith("expert_tensor_parallel_size=2: megamoe experts are "
                                            "not tensor-parallel")
    assert "set sequence_parallel=True" in messages["tp_without_sp"]
