"""Balance losses at TP=2 with sequence parallelism give the router gradients of TP=1 on the
same global batch: over two real gloo processes, and through the in-process mock."""
import pytest
import torch

import tp_workers
from megamoe.parallel.spawn import spawn_ranks as spawn
from megamoe import MoEConfig
from megamoe.layer import MoELayer
from mock_ranks import run_ranks


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return spawn(2, tp_workers.tp_job, str(tmp_path_factory.mktemp("tp2")), 300)


@pytest.mark.parametrize("case", sorted(tp_workers.TP_CASES))
def test_tp2_sequence_parallel_router_grads_equal_tp1(tp2, case):
    for rank, result in enumerate(tp2):
        got, expected = result[case]["got"], result[case]["expected"]
        assert float(expected.abs().sum()) > 0
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"rank {rank} {case}: {m}")


@pytest.mark.parametrize("case", sorted(tp_workers.TP_CASES))
def test_mock_tp2_router_grads_equal_tp1(case):
    S, B, D = tp_workers.S, tp_workers.B, tp_workers.D
    cfg = MoEConfig.from_dict({"hidden_size": D, "num_experts": 8, "ffn_hidden_size": 8,
                               "topk": 2, "init_method_std": 0.5, **tp_workers.TP_CASES[case]})
    torch.manual_seed(11)
    reference = MoELayer(cfg)
    x = torch.randn(S, B, D, generator=torch.Generator().manual_seed(3))
    expected = tp_workers.router_grads(reference, x)

    def rank(comm):
        layer = MoELayer(cfg, token_comm=comm, replica_comm=comm)
        layer.load_state_dict(reference.state_dict())
        return tp_workers.router_grads(layer, x.chunk(2, dim=0)[comm.rank])

    got = sum(run_ranks(2, rank))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
