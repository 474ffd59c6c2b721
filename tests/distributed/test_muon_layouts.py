"""Muon (`optimizer.name: muon`) trains the layout suite's tiny GPT-MoE at TP2+SP, PP2, DP2,
DP2xEP2 and EP2xTP2, and on four processes at TP2xDP2 and PP2xDP2 (distributed Muon's owners
agree across tensor-parallel peers and pipeline stages), as one process does, from the same
seed: per-step losses and gradient norms within the AdamW suite's tolerance (test_layouts.py). Tensor parallelism orthogonalises the
gathered full matrices (attention and the GLU halves of the dense fc1 included), expert
parallelism keeps each expert whole, data parallelism all-reduces the gradients; so these are
the one process's updates.

Distributed Muon (`optimizer.muon.distributed`, the default): at DP2 and DP2xEP2 the losses and
gradient norms equal the replicated version's (`distributed: false`) within 1e-6, and each
rank's optimizer state is its share: the two ranks' bytes sum to what one replicated rank holds,
and neither holds more than 55% of it.

Checkpoints: the one-process run resumed from its step-2 checkpoint gives bit-identical losses;
DP2xEP2's step-2 checkpoint resumed at one process, and DP2's resumed at EP2 (expert
data-parallel size 2 -> 1), continue the one-process run (Muon's momentum resharded as AdamW's
moments are); an AdamW checkpoint becomes a Muon run through `checkpoint.init_from`, never by
resuming.

In bf16 (fp32 main weights in Megatron's Float16OptimizerWithFloat16Params, sharded with the
rest), DP2 distributed equals replicated within 1e-6 with the same split of the state, and the
replicated run's checkpoint resumed distributed continues it. The trainer refuses bf16 on the
CPU (slow there), so these runs set it up directly (`bf16_job`).

Four spawns (two processes: the layouts, the replicated runs and the resume at EP2; four
processes: TP2xDP2 and PP2xDP2; two processes: the bf16 runs; then one process: the reference, the resumes and the AdamW -> Muon
switch), each loading megatron.core once.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import layout_workers as lw
from megamoe.parallel.spawn import spawn_ranks as spawn
from test_layouts import TOL, data  # noqa: F401  (the layout suite's dataset fixture)

RUN_TIMEOUT_S = 1200
pytestmark = pytest.mark.timeout(2400)
LAYOUTS = {"tp2_sp": {"tensor": 2}, "pp2": {"pipeline": 2}, "dp2": {},
           "dp2_ep2": {"expert": 2}, "ep2_tp2": {"expert": 2, "tensor": 2}}
LAYOUTS4 = {"tp2_dp2": {"tensor": 2}, "pp2_dp2": {"pipeline": 2}}  # four processes
REPLICATED = ("dp2", "dp2_ep2")  # also run with optimizer.muon.distributed=false
RESUMED = ("reference", "dp2", "dp2_ep2")  # resumed at one process from RESUME_AT
SAVED = RESUMED + ("dp2_replicated", "bf16_dp2_replicated")  # also checkpoint at RESUME_AT
SHARDED_TOL = 1e-6
QK_CLIP = {"tp2": {"tensor": 2}, "pp2": {"pipeline": 2}}  # MuonClip runs, with the reference's
QK_THRESHOLD = 0.02  # below the layout model's max logit at initialisation (about 0.07)


def _raw(data, root, name, parallel, distributed=True, qk_clip=False):  # noqa: F811
    raw = lw.config_dict(data, str(root / name), parallel)
    raw["optimizer"]["name"] = "muon"
    raw["optimizer"]["muon"] = {"distributed": distributed}
    if qk_clip:
        raw["optimizer"]["qk_clip_threshold"] = QK_THRESHOLD
    if name in SAVED:
        raw["checkpoint"]["interval"] = lw.RESUME_AT
    return raw


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("muon_layouts")
    replicated = [{"name": f"{name}_replicated",
                   "raw": _raw(data, root, f"{name}_replicated", LAYOUTS[name], False)}
                  for name in REPLICATED]
    at_ep2 = {"name": "dp2_resumed_ep2", "raw": _raw(data, root, "dp2_resumed_ep2",
                                                      {"expert": 2}),
              "resume_from": (str(root / "dp2"), lw.RESUME_AT)}
    to_sharded = {"name": "dp2_replicated_resumed", "raw": _raw(data, root,
                                                                "dp2_replicated_resumed", {}),
                  "resume_from": (str(root / "dp2_replicated"), lw.RESUME_AT)}
    qk_clip = [{"name": f"qk_clip_{name}",
                "raw": _raw(data, root, f"qk_clip_{name}", parallel, qk_clip=True)}
               for name, parallel in QK_CLIP.items()]
    world2 = spawn(2, lw.job, str(root / "spawn2"), RUN_TIMEOUT_S,
                   runs=[{"name": name, "raw": _raw(data, root, name, parallel)}
                         for name, parallel in LAYOUTS.items()] + replicated
                   + [at_ep2, to_sharded] + qk_clip)
    resumes = [{"name": f"{source}_resumed", "raw": _raw(data, root, f"{source}_resumed", {}),
                "resume_from": (str(root / source), lw.RESUME_AT)} for source in RESUMED]
    adamw = lw.config_dict(data, str(root / "adamw"), {})
    adamw["training"]["train_steps"] = lw.RESUME_AT
    world1 = spawn(1, switch_job, str(root / "spawn1"), RUN_TIMEOUT_S,
                   runs=[{"name": "reference", "raw": _raw(data, root, "reference", {})},
                         {"name": "qk_clip_reference",
                          "raw": _raw(data, root, "qk_clip_reference", {}, qk_clip=True)}]
                   + resumes, adamw=adamw,
                   to_muon=[_raw(data, root, name, {}) for name in ("resumed", "init_from")])
    world4 = spawn(4, lw.job, str(root / "spawn4"), RUN_TIMEOUT_S,
                   runs=[{"name": name, "raw": _raw(data, root, name, parallel)}
                         for name, parallel in LAYOUTS4.items()])
    bf16 = spawn(2, bf16_job, str(root / "spawn_bf16"), RUN_TIMEOUT_S,
                 runs=[{"name": "bf16_dp2", "raw": _raw(data, root, "bf16_dp2", {})},
                       {"name": "bf16_dp2_replicated",
                        "raw": _raw(data, root, "bf16_dp2_replicated", {}, False)},
                       {"name": "bf16_dp2_replicated_resumed",
                        "raw": _raw(data, root, "bf16_dp2_replicated_resumed", {}),
                        "resume_from": (str(root / "bf16_dp2_replicated"), lw.RESUME_AT)}])
    ranks = {f"{name}/ranks": [rank[name] for rank in world]
             for world in (world2, bf16) for name in world[0]}
    return {**world2[0], **world4[0], **bf16[0], **world1[0], **ranks}


def bf16_job(rank: int, world_size: int, runs: list[dict]) -> dict:
    """`layout_workers.job` with every model in bf16 (Megatron's Float16Module and fp32 main
    weights), which the trainer's config check allows on CUDA only."""
    from megamoe.train import loop

    prepare = loop._prepare
    loop._prepare = lambda config, on_cuda, bf16: prepare(config, on_cuda, True)
    return lw.job(rank, world_size, runs)


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


@pytest.mark.parametrize("name", list(LAYOUTS) + list(LAYOUTS4))
def test_muon_layout_trains_as_one_process(runs, name):
    reference, got = runs["reference"], runs[name]
    assert got["steps"] == list(range(1, lw.STEPS + 1))
    loss_diff = _max_diff(got["losses"], reference["losses"])
    norm_diff = _max_diff(got["grad_norms"], reference["grad_norms"])
    print(f"\nMUON {name}: max loss diff {loss_diff:.2e}, max grad norm diff {norm_diff:.2e}")
    assert reference["losses"][-1] < reference["losses"][0]  # the model learns
    assert loss_diff <= TOL, (got["losses"], reference["losses"])
    assert norm_diff <= TOL, (got["grad_norms"], reference["grad_norms"])


@pytest.mark.parametrize("name", REPLICATED)
def test_distributed_muon_trains_as_replicated(runs, name):
    """Sharded state, each rank updating its own parameters: the replicated run's curve."""
    got, replicated = runs[name], runs[f"{name}_replicated"]
    loss_diff = _max_diff(got["losses"], replicated["losses"])
    norm_diff = _max_diff(got["grad_norms"], replicated["grad_norms"])
    print(f"\nMUON {name} sharded vs replicated: max loss diff {loss_diff:.2e}, "
          f"max grad norm diff {norm_diff:.2e}")
    assert loss_diff <= SHARDED_TOL and norm_diff <= SHARDED_TOL


def test_distributed_muon_in_bf16(runs):
    """fp32 main weights sharded with the state: the replicated run's curve, each state once,
    and the replicated checkpoint resumed distributed continues the replicated run."""
    got, replicated = runs["bf16_dp2"], runs["bf16_dp2_replicated"]
    assert _max_diff(got["losses"], replicated["losses"]) <= SHARDED_TOL
    assert _max_diff(got["grad_norms"], replicated["grad_norms"]) <= SHARDED_TOL
    sharded = _optimizer_bytes(runs, "bf16_dp2")
    whole = _optimizer_bytes(runs, "bf16_dp2_replicated")
    assert sum(sharded) == whole[0] == whole[1] and max(sharded) <= 0.55 * whole[0]
    resumed = runs["bf16_dp2_replicated_resumed"]
    assert _max_diff(resumed["losses"], replicated["losses"][lw.RESUME_AT:]) <= SHARDED_TOL
    assert _max_diff(resumed["grad_norms"], replicated["grad_norms"][lw.RESUME_AT:]) <= SHARDED_TOL


def _optimizer_bytes(runs, name):
    return [rank["optimizer_bytes"] for rank in runs[f"{name}/ranks"]]


def test_distributed_muon_holds_each_state_once(runs):
    """At DP2 each rank holds its share of the optimizer state and together one replica's; at
    DP2xEP2 (each expert on one rank: not data-parallel) the dense part is shared out."""
    for name in REPLICATED:
        print(f"\nMUON {name} optimizer bytes per rank: sharded {_optimizer_bytes(runs, name)}, "
              f"replicated {_optimizer_bytes(runs, name + '_replicated')}")
    sharded, replicated = _optimizer_bytes(runs, "dp2"), _optimizer_bytes(runs, "dp2_replicated")
    assert replicated[0] == replicated[1] > 0
    assert sum(sharded) == replicated[0]
    assert max(sharded) <= 0.55 * replicated[0]
    sharded, replicated = (_optimizer_bytes(runs, "dp2_ep2"),
                           _optimizer_bytes(runs, "dp2_ep2_replicated"))
    assert all(s < r for s, r in zip(sharded, replicated))


@pytest.mark.parametrize("name", list(QK_CLIP))
def test_muon_clip_trains_as_one_process(runs, name):
    """MuonClip (QK-clip after each Muon step) at TP2 and PP2: the one-process run's losses and
    per-step max attention logits; the clip acts (the max logit, above 2 tau at step 1, is
    near tau from step 2: the few steps' small learning rate alone barely moves it)."""
    got, reference = runs[f"qk_clip_{name}"], runs["qk_clip_reference"]
    assert _max_diff(got["losses"], reference["losses"]) <= TOL
    assert _max_diff(got["max_logits"], reference["max_logits"]) <= TOL
    assert reference["max_logits"][0] > 2 * QK_THRESHOLD
    assert max(reference["max_logits"][1:]) < 1.5 * QK_THRESHOLD


def test_muon_resume_is_bit_exact(runs):
    """Steps 3-4 resumed from the step-2 checkpoint are the uninterrupted run's, bit for bit."""
    got, reference = runs["reference_resumed"], runs["reference"]
    assert got["steps"] == list(range(lw.RESUME_AT + 1, lw.STEPS + 1))
    assert got["losses"] == reference["losses"][lw.RESUME_AT:]
    assert got["grad_norms"] == reference["grad_norms"][lw.RESUME_AT:]


@pytest.mark.parametrize("name", ["dp2_ep2_resumed", "dp2_resumed", "dp2_resumed_ep2",
                                  "dp2_replicated_resumed"])
def test_muon_checkpoint_reshards(runs, name):
    """DP2xEP2's and DP2's step-2 checkpoints resumed at one process, DP2's at EP2, and the
    replicated DP2 run's with distributed Muon continue the one-process run."""
    got, reference = runs[name], runs["reference"]
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
