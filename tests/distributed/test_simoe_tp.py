"""SIMoE at tensor parallelism 2 equals one process: losses, mask densities, Lagrange multipliers
and every trainable parameter (deltas, gates, router) after a few training steps; its torch_dist
checkpoint, saved at TP=2, loads at TP=1 into the same model; LoRA, the study's baseline, too."""
import simoe_workers
from megamoe.parallel.spawn import spawn_ranks as spawn

TOL = 1e-5
# Parameters after Adam steps: Adam divides by the gradient's own size, so a gradient that is
# rounding noise (summed in another order over the TP group) still moves its weight by ~lr.
PARAM_TOL = 1e-4


def test_simoe_and_lora_at_tp2_train_and_checkpoint_exactly_as_one_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    two = spawn(2, simoe_workers.simoe_tp_job, str(tmp_path / "tp2"), 300, ckpt_dir=str(ckpt))
    (one,) = spawn(1, simoe_workers.simoe_tp_job, str(tmp_path / "tp1"), 300, ckpt_dir=str(ckpt))
    assert (one["loaded_eval"] - one["eval"]).abs().max() < TOL
    for rank in two:
        for key in ("losses", "eval", "density", "multipliers", "lora_losses"):
            assert (rank[key] - one[key]).abs().max() < TOL, key
        for group in ("params", "lora_params"):
            assert set(rank[group]) == set(one[group])
            for name, value in one[group].items():
                assert (rank[group][name] - value).abs().max() < PARAM_TOL, name
    assert one["multipliers"].abs().sum() > 0  # the dual step ran
    assert all(v.abs().max() > 0 for k, v in one["params"].items() if "delta" in k)
    assert all(v.abs().max() > 0 for k, v in one["lora_params"].items() if k.endswith("lora_b"))
