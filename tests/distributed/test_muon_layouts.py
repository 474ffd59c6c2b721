"""Muon (`optimizer.name: muon`) trains the layout suite's tiny GPT-MoE at TP2+SP, PP2, DP2xEP2
and EP2xTP2 as one process does, from the same seed: per-step losses and gradient norms within
the AdamW suite's tolerance (test_layouts.py). Tensor parallelism orthogonalises the gathered
full matrices (attention and the GLU halves of the dense fc1 included), expert parallelism
keeps each expert whole, data parallelism all-reduces the gradients; so these are the one
process's updates. Its checkpoints: the one-process run resumed from its step-2 checkpoint
gives bit-identical losses; DP2xEP2's step-2 checkpoint resumed at one process continues the
one-process run (Muon's momentum resharded as AdamW's moments are); an AdamW checkpoint
becomes a Muon run through `checkpoint.init_from`, never by resuming.

Two spawns (two processes: the four layouts; then one process: the reference, the two
resumes and the AdamW -> Muon switch), each loading megatron.core once.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import layout_workers as lw
from megamoe.parallel.spawn import spawn_ranks as spawn
from test_layouts import TOL, data  # noqa: F401  (the layout suite's dataset fixture)

RUN_TIMEOUT_S = 1200
pytestmark = pytest.mark.timeout(2400)
LAYOUTS = {"tp2_sp": {"tensor": 2}, "pp2": {"pipeline": 2}, "dp2_ep2": {"expert": 2},
           "ep2_tp2": {"expert": 2, "tensor": 2}}
SAVED = ("reference", "dp2_ep2")  # runs that also checkpoint at RESUME_AT


def _raw(data, root, name, parallel):  # noqa: F811
    raw = lw.config_dict(data, str(root / name), parallel)
    raw["optimizer"]["name"] = "muon"
    if name in SAVED:
        raw["checkpoint"]["interval"] = lw.RESUME_AT
    return raw


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("muon_layouts")
    world2 = spawn(2, lw.job, str(root / "spawn2"), RUN_TIMEOUT_S,
                   runs=[{"name": name, "raw": _raw(data, root, name, parallel)}
                         for name, parallel in LAYOUTS.items()])
    resumes = [{"name": f"{source}_resumed", "raw": _raw(data, root, f"{source}_resumed", {}),
                "resume_from": (str(root / source), lw.RESUME_AT)} for source in SAVED]
    adamw = lw.config_dict(data, str(root / "adamw"), {})
    adamw["training"]["train_steps"] = lw.RESUME_AT
    world1 = spawn(1, switch_job, str(root / "spawn1"), RUN_TIMEOUT_S,
                   runs=[{"name": "reference", "raw": _raw(data, root, "reference", {})}]
                   + resumes, adamw=adamw,
                   to_muon=[_raw(data, root, name, {}) for name in ("resumed", "init_from")])
    return {**world2[0], **world1[0]}


def switch_job(rank: int, world_size: int, runs: list[dict], adamw: dict,
               to_muon: list[dict]) -> dict:
    """`runs` (layout_workers.job), then an AdamW run whose checkpoint Muon runs start from:
    resumed (refused: the error's text) and through checkpoint.init_from (its result)."""
    from megamoe.errors import CheckpointError

    results = lw.job(rank, world_size, runs + [{"name": "adamw", "raw": adamw}])
    resumed, init_from = to_muon
    lw.resume_folder(adamw["output_dir"], lw.RESUME_AT, resumed["output_dir"])
    try:
        lw.train(resumed)
    except CheckpointError as err:
        results["refused"] = str(err)
    init_from["checkpoint"]["init_from"] = str(Path(adamw["output_dir"]) / "checkpoints")
    results["init_from"] = lw.train(init_from)
    return results


def _max_diff(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_trains_as_one_process(runs, name):
    reference, got = runs["reference"], runs[name]
    assert got["steps"] == list(range(1, lw.STEPS + 1))
    loss_diff = _max_diff(got["losses"], reference["losses"])
    norm_diff = _max_diff(got["grad_norms"], reference["grad_norms"])
    print(f"\nMUON {name}: max loss diff {loss_diff:.2e}, max grad norm diff {norm_diff:.2e}")
    assert reference["losses"][-1] < reference["losses"][0]  # the model learns
    assert loss_diff <= TOL, (got["losses"], reference["losses"])
    assert norm_diff <= TOL, (got["grad_norms"], reference["grad_norms"])


def test_muon_resume_is_bit_exact(runs):
    """Steps 3-4 resumed from the step-2 checkpoint are the uninterrupted run's, bit for bit."""
    got, reference = runs["reference_resumed"], runs["reference"]
    assert got["steps"] == list(range(lw.RESUME_AT + 1, lw.STEPS + 1))
    assert got["losses"] == reference["losses"][lw.RESUME_AT:]
    assert got["grad_norms"] == reference["grad_norms"][lw.RESUME_AT:]


def test_muon_checkpoint_reshards(runs):
    """DP2xEP2's step-2 checkpoint resumed at one process continues the one-process run."""
    got, reference = runs["dp2_ep2_resumed"], runs["reference"]
    assert got["steps"] == list(range(lw.RESUME_AT + 1, lw.STEPS + 1))
    assert _max_diff(got["losses"], reference["losses"][lw.RESUME_AT:]) <= TOL
    assert _max_diff(got["grad_norms"], reference["grad_norms"][lw.RESUME_AT:]) <= TOL


def test_adamw_checkpoint_switches_to_muon_only_by_init_from(runs):
    """Resuming an AdamW checkpoint with optimizer.name=muon is refused in one line naming the
    setting and the fix; checkpoint.init_from takes its weights into a Muon run (whose first
    loss is then below a fresh Muon run's)."""
    refused = runs.get("refused")
    assert refused is not None and "\n" not in refused
    assert "optimizer.name=adamw, this run sets optimizer.name=muon" in refused
    assert "checkpoint.init_from=" in refused
    switched = runs["init_from"]
    assert switched["steps"] == list(range(1, lw.STEPS + 1))
    assert switched["losses"][0] < runs["reference"]["losses"][0] - 0.05
