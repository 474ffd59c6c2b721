"""SIMoE at tensor parallelism 2 equals one process: losses, mask densities, Lagrange multipliers
and every trainable parameter (deltas, gates, router) after a few training steps; and its
torch_dist checkpoint, saved at TP=2, loads at TP=1 into the same model."""
import simoe_workers
from ep_harness import spawn

TOL = 1e-5


def test_simoe_tp2_trains_and_checkpoints_exactly_as_one_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    two = spawn(2, simoe_workers.simoe_tp_job, str(tmp_path / "tp2"), 300, ckpt_dir=str(ckpt))
    (one,) = spawn(1, simoe_workers.simoe_tp_job, str(tmp_path / "tp1"), 300, ckpt_dir=str(ckpt))
    assert (one["loaded_eval"] - one["eval"]).abs().max() < TOL
    for rank in two:
        assert (rank["losses"] - one["losses"]).abs().max() < TOL
        assert (rank["eval"] - one["eval"]).abs().max() < TOL
        assert (rank["density"] - one["density"]).abs().max() < TOL
        assert (rank["multipliers"] - one["multipliers"]).abs().max() < TOL
        assert set(rank["params"]) == set(one["params"])
        for name, value in one["params"].items():
            assert (rank["params"][name] - value).abs().max() < TOL, name
    assert one["multipliers"].abs().sum() > 0  # the dual step ran
    assert all(v.abs().max() > 0 for k, v in one["params"].items() if "delta" in k)
