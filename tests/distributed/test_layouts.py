"""Every parallel layout trains the tiny GPT-MoE exactly as one process does, through the real
trainer (Megatron-Core DDP, distributed optimizer, pipeline schedules, finalize_model_grads),
every run starting from nothing but the same seed (the initial weights are layout-invariant):
per-step losses and gradient norms, final weights and expert biases within 1e-4 (fp32), expert
biases identical on every rank, and (without pipelining) the held-out evaluation's loss and
routing. Checkpoints saved at one layout resume at another (TP 2->1,
PP 2->1->2, EP 2->4, TP2xPP2xEP2 -> one process) with the losses of an uninterrupted run at the
new layout; the reference's recorded routing replays at DP2xEP2 and PP2 (routing replay); and
TP 1->2->1 with a vocabulary padded differently at each size (the saved rows
carried bit for bit, padding rows added or dropped). Full and selective activation recomputation
give the same gradients (norms), weights and biases (each token counted once). The model's MLA
variant (multi-head latent attention, with latent MoE layers under quantile balancing) trains at
TP2+SP (its up projections recomputed), PP2 and DP2xEP2 as its own one-process reference does;
so does its MTP variant (multi-token prediction, one depth with a megamoe layer on the last
pipeline stage; its MoE layers have zero-computation experts, the first one routes by a hash
table), its per-depth loss included, and its PP2 checkpoint resumes at one process.

Spawns, in order (each imports megatron.core once and runs several layouts): one process
(references, recompute runs, the vocabulary's TP1 run), two (five layouts, first resume legs,
vocabulary TP 1->2, two replays of the reference's routing), four (three layouts, EP 2->4), one (resumes at one process, vocabulary
TP 2->1, final weights of all), two (PP 1->2, the vocabulary's TP2 run resumed at TP2).
"""
from __future__ import annotations

import math
import time

import pytest
import torch

import layout_workers as lw
from megamoe.parallel.spawn import spawn_ranks as spawn

TOL = 1e-4
RUN_TIMEOUT_S = 1200
# The first test builds every session fixture (all spawns, ~5 minutes on 2 quiet cores).
pytestmark = pytest.mark.timeout(3600)
TIMINGS: dict[str, float] = {}
VOCAB_HOP = lw.RESUME_AT + 1  # vocab_tp2's checkpoint that the hop back to TP1 starts from
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
VOCAB_KEYS = [f"{state}{key}" for key in VOCAB_TENSORS  # with their optimizer states
              for state in ("", "optimizer.state.param.", "optimizer.state.exp_avg.",
                            "optimizer.state.exp_avg_sq.")]


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> dict:
    """A small indexed dataset (seeded random sentences over 300 made-up words) with its own
    512-token tokenizer."""
    import random

    from megamoe.train.data_prep import preprocess

    root = tmp_path_factory.mktemp("layout_data")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
             for _ in range(300)]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "."
            for _ in range(400)]
    (root / "docs.txt").write_text("\n\n".join(docs))
    prefix = root / "corpus"
    preprocess([root / "docs.txt"], prefix, vocab_size=512, progress=False)
    return {"prefixes": [str(prefix)], "tokenizer_model": f"{prefix}.model"}


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


def _raw(data, root, name, parallel, training=None, sections=None):
    return lw.config_dict(data, str(root / name), parallel, training, sections)


def _spawn(label, world, fn, root, **kwargs):
    start = time.monotonic()
    out = spawn(world, fn, str(root / f"spawn_{label}"), RUN_TIMEOUT_S, **kwargs)
    TIMINGS[label] = time.monotonic() - start
    return out


@pytest.fixture(scope="session")
def world1a(data, root):
    """The single-process reference; full and selective recompute; dropout on."""
    runs = [{"name": "reference", "raw": lw.recording(_raw(data, root, "reference", {}))},
            {"name": "mla_reference", "raw": _raw(data, root, "mla_reference", {}, None, lw.MLA)},
            {"name": "mtp_reference", "raw": _raw(data, root, "mtp_reference", {}, None, lw.MTP)},
            ] + [{"name": name, "raw": _raw(data, root, name, {}, settings)}
                 for name, settings in lw.RECOMPUTE.items()] + _layout_runs(data, root, 1) + [
        {"name": "vocab_tp1", "raw": _raw(data, root, "vocab_tp1", {}, None, lw.VOCAB)}]
    return _spawn("world1a", 1, lw.job, root, runs=runs)


def _layout_runs(data, root, world):
    """The layouts of `world` processes, then those with dropout and router jitter on, then
    the MLA and MTP variants'."""
    return [{"name": name, "raw": _raw(data, root, name, parallel)}
            for name, (procs, parallel) in lw.LAYOUTS.items() if procs == world] + [
        {"name": name, "raw": _raw(data, root, name, parallel, training, sections)}
        for variants, sections in [(lw.RANDOM_LAYOUTS, lw.RANDOM), (lw.MLA_LAYOUTS, lw.MLA),
                                   (lw.MTP_LAYOUTS, lw.MTP)]
        for name, (procs, parallel, training) in variants.items() if procs == world]


@pytest.fixture(scope="session")
def world2a(world1a, data, root):
    """The layouts of two processes, then vocab_tp1's step-2 checkpoint resumed at TP2 (its
    vocabulary padded to 576 rows instead of 528), saved as loaded and every step after."""
    vocab = {"name": "vocab_tp2", "raw": _raw(data, root, "vocab_tp2", {"tensor": 2}, None,
                                              {**lw.VOCAB, "checkpoint": {"interval": 1}}),
             "resume_from": (str(root / "vocab_tp1"), lw.RESUME_AT),
             "snapshot": str(root / "vocab_tp2" / "loaded")}
    replays = [{"name": name, "raw": lw.replaying(_raw(data, root, name, parallel),
                                                  str(root / "reference"))}
               for name, (_, parallel) in lw.REPLAY_LAYOUTS.items()]
    return _spawn("world2a", 2, lw.job, root,
                  runs=_layout_runs(data, root, 2) + [vocab] + replays)


@pytest.fixture(scope="session")
def world4(world2a, data, root):
    """Three layouts, then EP 2->4: dp2_ep2's step-2 checkpoint resumed at EP=4."""
    resume = {"name": "resume_ep2_to_ep4", "raw": _raw(data, root, "resume_ep2_to_ep4",
                                                       {"expert": 4}),
              "resume_from": (str(root / "dp2_ep2"), lw.RESUME_AT)}
    return _spawn("world4", 4, lw.job, root, runs=_layout_runs(data, root, 4) + [resume])


@pytest.fixture(scope="session")
def world1b(world4, data, root):
    """Resumes at one process (TP 2->1, PP 2->1 for one step, TP2xPP2xEP2 -> 1, and vocab_tp2's
    step-3 checkpoint, saved as loaded), then the final weights of every run against the
    reference's, and vocab_tp2's step-3 weights loaded into the one-process model of the
    tokenizer's vocabulary (576 rows to 528)."""
    runs = [
        {"name": "resume_tp2_to_tp1", "raw": _raw(data, root, "resume_tp2_to_tp1", {}),
         "resume_from": (str(root / "tp2_sp"), lw.RESUME_AT)},
        {"name": "resume_pp2_to_pp1", "raw": _raw(data, root, "resume_pp2_to_pp1", {},
                                                  {"exit_interval": lw.RESUME_AT + 1}),
         "resume_from": (str(root / "pp2"), lw.RESUME_AT)},
        {"name": "resume_mixed_to_1", "raw": _raw(data, root, "resume_mixed_to_1", {}),
         "resume_from": (str(root / "tp2_pp2_ep2"), lw.RESUME_AT)},
        {"name": "vocab_back_tp1", "raw": _raw(data, root, "vocab_back_tp1", {}, None, lw.VOCAB),
         "resume_from": (str(root / "vocab_tp2"), VOCAB_HOP),
         "snapshot": str(root / "vocab_back_tp1" / "loaded")},
        {"name": "resume_mtp_pp2_to_1", "raw": _raw(data, root, "resume_mtp_pp2_to_1", {}, None,
                                                    lw.MTP),
         "resume_from": (str(root / "mtp_pp2"), lw.RESUME_AT)},
    ]
    groups = [(_raw(data, root, "reference", {}),
               ["reference", *lw.RECOMPUTE, *lw.LAYOUTS, "resume_ep2_to_ep4",
                "resume_tp2_to_tp1", "resume_mixed_to_1"]),
              (_raw(data, root, "mla_reference", {}, None, lw.MLA),
               ["mla_reference", *lw.MLA_LAYOUTS]),
              (_raw(data, root, "mtp_reference", {}, None, lw.MTP),
               ["mtp_reference", *lw.MTP_LAYOUTS, "resume_mtp_pp2_to_1"])]
    compare = [{name: (reference, str(root / name / "checkpoints")) for name in names}
               for reference, names in groups]
    vocab_loads = {"vocab_tp2_at_tp1": (_raw(data, root, "vocab_tp1", {}, None, lw.VOCAB),
                                        str(_vocab_checkpoint(root, "vocab_tp2", VOCAB_HOP)))}
    return _spawn("world1b", 1, lw.weights_job, root, runs=runs, compare=compare,
                  vocab_loads=vocab_loads)


@pytest.fixture(scope="session")
def world2b(world1b, data, root):
    """PP 1->2: the PP=1 leg's last checkpoint resumed at PP=2 for the remaining step; and
    vocab_tp2's step-3 checkpoint resumed at its own layout."""
    runs = [{"name": "resume_pp1_to_pp2", "raw": _raw(data, root, "resume_pp1_to_pp2",
                                                      {"pipeline": 2}),
             "resume_from": (str(root / "resume_pp2_to_pp1"), lw.RESUME_AT + 1)},
            {"name": "vocab_tp2_resumed", "raw": _raw(data, root, "vocab_tp2_resumed",
                                                      {"tensor": 2}, None, lw.VOCAB),
             "resume_from": (str(root / "vocab_tp2"), VOCAB_HOP)}]
    return _spawn("world2b", 2, lw.job, root, runs=runs)


def _result(name, world1a, world2a, world4, world1b, world2b):
    for spawned in (world1a, world2a, world4, world1b, world2b):
        if name in spawned[0]:
            return spawned
    raise KeyError(name)


def _max_diff(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="session")
def everything(world1a, world2a, world4, world1b, world2b):
    return world1a, world2a, world4, world1b, world2b


def _moe_layers(name: str) -> list[int]:
    """The global numbers of the MoE layers of run `name`'s model: layers 2-4, and 5 (the
    multi-token-prediction depth) in the MTP variant."""
    return [2, 3, 4] + ([5] if name in lw.MTP_LAYOUTS or name.startswith("mtp_") else [])


def _biased_layers(name: str) -> list[int]:
    """The MoE layers with a bias: all but the MTP variant's hash layer."""
    mtp = name in lw.MTP_LAYOUTS or name.startswith("mtp_")
    return [n for n in _moe_layers(name) if not (mtp and n == lw.MTP_HASH_LAYER)]


def _check_biases_replicated(ranks, name):
    """Every rank holding a layer's router has the same expert bias."""
    seen: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        for layer, bias in result[name]["biases"].items():
            if layer in seen:
                torch.testing.assert_close(bias, seen[layer], rtol=0, atol=0,
                                           msg=lambda m: f"{name} rank {rank} {layer}: {m}")
            seen[layer] = bias
    assert sorted(seen) == [f"layer {n}" for n in _biased_layers(name)], f"{name}: {sorted(seen)}"


@pytest.mark.parametrize("name", [*lw.LAYOUTS, *lw.RECOMPUTE, *lw.MLA_LAYOUTS,
                                  *lw.MTP_LAYOUTS])
def test_layout_trains_as_one_process(everything, name):
    world1a, *_ = everything
    reference = world1a[0]["mla_reference" if name in lw.MLA_LAYOUTS else
                           "mtp_reference" if name in lw.MTP_LAYOUTS else "reference"]
    ranks = _result(name, *everything)
    got = ranks[0][name]
    assert got["steps"] == list(range(1, lw.STEPS + 1))
    loss_diff = _max_diff(got["losses"], reference["losses"])
    norm_diff = _max_diff(got["grad_norms"], reference["grad_norms"])
    weight_diffs = everything[3][0]["weight_diffs"][name]
    weight_diff = max(weight_diffs.values())
    print(f"\nLAYOUT {name}: processes {len(ranks)}, max loss diff {loss_diff:.2e}, max grad "
          f"norm diff {norm_diff:.2e}, max weight diff {weight_diff:.2e}, run {got['seconds']:.1f} s")
    assert reference["losses"][-1] < reference["losses"][0]  # the model learns
    assert loss_diff <= TOL, (got["losses"], reference["losses"])
    assert norm_diff <= TOL, (got["grad_norms"], reference["grad_norms"])
    if name in lw.MTP_LAYOUTS:  # the depth's own loss, logged per step, as one process's
        assert all(loss is not None for loss in reference["mtp_losses"])
        assert _max_diff(got["mtp_losses"], reference["mtp_losses"]) <= TOL
        assert any(k.startswith("mtp.layers.0.") for k in weight_diffs)
    worst = max(weight_diffs, key=weight_diffs.get)
    assert weight_diff <= TOL, f"{worst}: {weight_diff}"
    assert any(k.endswith(lw.BIAS_KEYS) for k in weight_diffs)
    if name in lw.MLA_LAYOUTS:  # latent experts balanced by quantile balancing
        assert any(k.endswith("fc1_latent_proj.weight") for k in weight_diffs)
        assert any(k.endswith("qb_beta") for k in weight_diffs)
    _check_biases_replicated(ranks, name)
    _check_heldout(got["heldout"], reference["heldout"], name)


def _check_heldout(got: dict, reference: dict, name: str) -> None:
    """The end-of-run held-out evaluation (eval mode, on the CPU collectives of the layout) as
    one process's: the loss, and each MoE layer's experts per token; pipelined layouts do not
    evaluate, sequence-parallel ones cannot pair a token's routing with its loss."""
    parallel = {**lw.LAYOUTS, **lw.MLA_LAYOUTS, **lw.MTP_LAYOUTS}.get(name, (1, {}))[1]
    if parallel.get("pipeline", 1) > 1:
        assert got == {}, name
        return
    routing = {k for k in reference if k.endswith("/experts_per_token")}
    assert len(routing) == len(_moe_layers(name)), sorted(reference)  # layers 2-4 (and 5)
    assert abs(got["heldout_loss"] - reference["heldout_loss"]) <= TOL
    assert {k: got[k] for k in routing} == {k: reference[k] for k in routing}
    assert ("heldout/layer2/loss_by_experts" in got) == (parallel.get("tensor", 1) == 1)


@pytest.mark.parametrize("name", [n for n in lw.RANDOM_LAYOUTS if n != "random_reference"])
def test_dropout_and_jitter_draw_as_one_process(everything, name):
    """With dropout and router jitter on, pipeline, expert and data parallelism (and full
    recomputation, which replays the draws) train as one process with the same draws."""
    reference = everything[0][0]["random_reference"]
    without = everything[0][0]["reference"]
    got = _result(name, *everything)[0][name]
    loss_diff = _max_diff(got["losses"], reference["losses"])
    norm_diff = _max_diff(got["grad_norms"], reference["grad_norms"])
    print(f"\nRANDOM {name}: max loss diff {loss_diff:.2e}, max grad norm diff {norm_diff:.2e} "
          f"(dropout changes the loss by {_max_diff(reference['losses'], without['losses']):.2e})")
    assert _max_diff(reference["losses"], without["losses"]) > 1e-3  # the draws matter
    assert loss_diff <= TOL, (got["losses"], reference["losses"])
    assert norm_diff <= TOL, (got["grad_norms"], reference["grad_norms"])


@pytest.mark.parametrize("name", lw.REPLAY_LAYOUTS)
def test_a_replayed_record_routes_the_same_tokens_to_the_same_experts(everything, name):
    """The reference recorded its routing; these runs, at another layout and with a bias 50x
    faster (so their routers alone would route otherwise), replay it: every step's expert loads
    are the reference's exactly, and so are the losses (the bias only selects experts)."""
    reference = everything[0][0]["reference"]
    got = _result(name, *everything)[0][name]
    assert got["loads"] == reference["loads"] and len(got["loads"]) == lw.STEPS
    assert _max_diff(got["losses"], reference["losses"]) <= TOL


def test_expert_biases_moved(everything):
    """The loss-free bias is live in these runs (so equal biases mean something); a layer's
    +-rate steps may cancel out over 4 steps, so some layer, not every one, has moved."""
    biases = everything[3][0]["reference_bias"]
    assert len(biases) == 3 and any(float(b.abs().max()) > 0 for b in biases.values())


FIRST = lw.RESUME_AT + 1
RESUMES = {  # name: (uninterrupted run at the new layout, first and last resumed step)
    "resume_tp2_to_tp1": ("reference", FIRST, lw.STEPS),
    "resume_pp2_to_pp1": ("reference", FIRST, FIRST),
    "resume_pp1_to_pp2": ("pp2", FIRST + 1, lw.STEPS),
    "resume_ep2_to_ep4": ("dp4_ep4", FIRST, lw.STEPS),
    "resume_mixed_to_1": ("reference", FIRST, lw.STEPS),
    "resume_mtp_pp2_to_1": ("mtp_reference", FIRST, lw.STEPS),
}


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resharding_resume_continues_the_run(everything, name):
    uninterrupted_name, first, last = RESUMES[name]
    got = _result(name, *everything)[0][name]
    uninterrupted = _result(uninterrupted_name, *everything)[0][uninterrupted_name]
    assert got["steps"] == list(range(first, last + 1))
    expected = uninterrupted["losses"][first - 1:last]
    diff = _max_diff(got["losses"], expected)
    print(f"\nRESUME {name}: max loss diff {diff:.2e} vs {uninterrupted_name}, run "
          f"{got['seconds']:.1f} s")
    assert diff <= TOL, (got["losses"], expected)
    norm_diff = _max_diff(got["grad_norms"], uninterrupted["grad_norms"][first - 1:last])
    assert norm_diff <= TOL
    if name in everything[3][0]["weight_diffs"]:
        assert max(everything[3][0]["weight_diffs"][name].values()) <= TOL


def _vocab_checkpoint(root, name: str, step: int, folder: str = "checkpoints"):
    return root / name / folder / f"iter_{step:07d}"


def _vocab_tensors(folder) -> dict:
    """The vocabulary tensors and their optimizer states saved in `folder`, read whole by
    DCP's own reader (not by Megatron-Core's loader)."""
    from megamoe.checkpointing.dcp_reader import DCPReader

    reader = DCPReader(folder)
    return {key: reader.read(key) for key in VOCAB_KEYS}


def _assert_rows_carried(saved, loaded, rows: int, what: str) -> None:
    """`loaded` has `rows` rows: as many of `saved`'s as fit, bit-identical, then zeros."""
    assert loaded.shape == (rows, saved.shape[1]), (what, loaded.shape)
    kept = min(rows, len(saved))
    assert torch.equal(loaded[:kept], saved[:kept]), what
    assert not loaded[kept:].any(), what


def test_vocabulary_padded_for_another_tensor_parallel_size(everything, root):
    """TP1 -> TP2 -> TP1 with a vocabulary padded to 528 rows at TP1 and 576 at TP2: each hop
    carries every saved row the new model has room for bit for bit (weights, fp32 main weights
    and Adam moments), padding rows added are zero and those dropped are gone, and the run goes
    on: finite losses across the hops, and at the same layout as the uninterrupted run's."""
    world1a, world2a, _, world1b, world2b = everything
    tp1 = _vocab_tensors(_vocab_checkpoint(root, "vocab_tp1", lw.RESUME_AT))
    at_tp2 = _vocab_tensors(_vocab_checkpoint(root, "vocab_tp2", lw.RESUME_AT, "loaded"))
    tp2 = _vocab_tensors(_vocab_checkpoint(root, "vocab_tp2", VOCAB_HOP))
    back = _vocab_tensors(_vocab_checkpoint(root, "vocab_back_tp1", VOCAB_HOP, "loaded"))
    init_from = world1b[0]["vocab_loads"]["vocab_tp2_at_tp1"]
    assert sorted(init_from) == sorted(VOCAB_TENSORS)
    for key in VOCAB_KEYS:
        assert len(tp1[key]) == 528 and len(tp2[key]) == 576, key
        _assert_rows_carried(tp1[key], at_tp2[key], 576, f"TP1 -> TP2 {key}")
        # resumed at TP1 the model keeps at least the tokenizer's rows padded for TP1
        assert len(back[key]) >= 528 and len(back[key]) % 48 == 0, key
        _assert_rows_carried(tp2[key], back[key], len(back[key]), f"TP2 -> TP1 {key}")
        if key in init_from:  # the model of the tokenizer's vocabulary, through init_from
            _assert_rows_carried(tp2[key], init_from[key], 528, f"TP2 -> TP1 init_from {key}")
    runs = {"vocab_tp1": world1a, "vocab_tp2": world2a, "vocab_back_tp1": world1b,
            "vocab_tp2_resumed": world2b}
    got = {name: spawned[0][name] for name, spawned in runs.items()}
    assert got["vocab_tp2"]["steps"] == [lw.RESUME_AT + 1, lw.STEPS]
    assert got["vocab_back_tp1"]["steps"] == got["vocab_tp2_resumed"]["steps"] == [lw.STEPS]
    assert all(math.isfinite(loss) for run in got.values() for loss in run["losses"])
    assert got["vocab_tp2_resumed"]["losses"] == got["vocab_tp2"]["losses"][-1:]
    assert got["vocab_tp2_resumed"]["grad_norms"] == got["vocab_tp2"]["grad_norms"][-1:]


def test_timings(everything):
    print("\nSPAWN TIMES " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMINGS.items()))
