"""Expert-threshold, Sinkhorn and BASE routing, the ERC loss and Skywork's logit normalisation
at EP=N on N gloo processes against EP=1 in one process on the whole batch (Sinkhorn and BASE
solve one assignment over the group's tokens, so they must match it exactly)."""
import pytest
import torch

import router_workers
from megamoe.parallel.spawn import spawn_ranks as spawn


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(f"routers{request.param}"))
    return spawn(request.param, router_workers.routers_job, out, timeout_s=900)


@pytest.mark.parametrize("case", sorted(router_workers.ROUTER_CASES))
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_router_matches_ep1(results, case, dispatcher):
    for rank, result in enumerate(results):
        for name, (got, expected) in result[f"{case}/{dispatcher}"]["pairs"].items():
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
