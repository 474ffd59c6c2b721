"""The memory planner without spawning (tools/plan_memory.py, megamoe.plan): parameter counts
of the shipped recipes against hand formulas from the models' published architectures and
against their published totals, one stage's counted state against a hand formula, the
pipeline schedule's in-flight micro-batches, the forced routing of --measure, the JSON
schema, and the CLI's one-line errors (exit code 2, no output file)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tool_modules import tool_module

REPO = Path(__file__).resolve().parents[2]


def _attention(h, heads, groups, d, qkv_bias=False, o_bias=False, sinks=False, qk_norm=None):
    """Grouped-query attention by hand: q/k/v/o projections, their biases, one sink logit per
    head, QK RMSNorms over each head (`head`) or over the whole q and k projections
    (`projection`), and the layer's input norm."""
    return (2 * h * heads * d + 2 * h * groups * d + h
            + (heads * d + 2 * groups * d if qkv_bias else 0) + (h if o_bias else 0)
            + (heads if sinks else 0)
            + {None: 0, "head": 2 * d, "projection": (heads + groups) * d}[qk_norm])


def _mtp_depth(h, layer):
    """One multi-token-prediction depth (DeepSeek-V3, arXiv 2412.19437 sec. 2.2): the two input
    RMSNorms, the 2h x h projection, one transformer layer, the final RMSNorm."""
    return 2 * h + 2 * h * h + layer + h


def _deepseek_v3(vocab=129_280, h=7168, layers=61, dense=3, dense_ffn=18_432, experts=256,
                 ffn=2048, shared=2048, topk=8, heads=128, q_lora=1536, kv_lora=512,
                 qk=128, rope=64, v=128, mtp=1):
    """DeepSeek-V3 (arXiv 2412.19437) by hand, its multi-token-prediction depth (a MoE layer)
    in the total; active without it."""
    attention = (h * q_lora + q_lora + q_lora * heads * (qk + rope) + h * (kv_lora + rope)
                 + kv_lora + kv_lora * heads * (qk + v) + heads * v * h)
    expert = 3 * h * ffn
    moe = experts * expert + 3 * h * shared + experts * h
    main = 2 * vocab * h + layers * (attention + 2 * h) + dense * 3 * h * dense_ffn \
        + (layers - dense) * moe + h
    return (main + mtp * _mtp_depth(h, attention + 2 * h + moe),
            main - (layers - dense) * (experts - topk) * expert)


def _mixtral(vocab=32_000, h=4096, layers=32, heads=32, groups=8, d=128, experts=8,
             ffn=14_336, topk=2):
    """Mixtral 8x7B (arXiv 2401.04088) by hand."""
    expert = 3 * h * ffn
    total = 2 * vocab * h + layers * (_attention(h, heads, groups, d) + h + experts * expert
                                      + experts * h) + h
    return total, total - layers * (experts - topk) * expert


def _glm4_5(vocab=151_552, h=5120, layers=92, dense=3, dense_ffn=12_288, experts=160,
            ffn=1536, topk=8, heads=96, groups=8, d=128, mtp=1):
    """GLM-4.5 (arXiv 2508.06471; its config.json) by hand: q/k/v biases, per-head QK norms, a
    shared expert, one multi-token-prediction depth (a MoE layer); active without it."""
    attention = _attention(h, heads, groups, d, qkv_bias=True, qk_norm="head") + h
    expert = 3 * h * ffn
    moe = attention + experts * expert + expert + experts * h
    main = 2 * vocab * h + dense * (attention + 3 * h * dense_ffn) + (layers - dense) * moe + h
    return main + mtp * _mtp_depth(h, moe), main - (layers - dense) * (experts - topk) * expert


def _gpt_oss(vocab=201_088, h=2880, layers=36, heads=64, groups=8, d=64, experts=128,
             ffn=2880, topk=4):
    """GPT-OSS-120b (its model card, arXiv 2508.10925; config.json) by hand: biases on q/k/v/o,
    a sink logit per head, experts with biases on gate_up and down, a router with a bias."""
    attention = _attention(h, heads, groups, d, qkv_bias=True, o_bias=True, sinks=True) + h
    expert = 3 * h * ffn + 2 * ffn + h
    total = 2 * vocab * h + layers * (attention + experts * expert + experts * h + experts) + h
    return total, total - layers * (experts - topk) * expert


@functools.lru_cache(maxsize=None)
def _compared(name):
    """The planner's counts of a released model (`megamoe.plan.published`), built once."""
    from megamoe.plan.published import RELEASES, compare

    (release,) = [r for r in RELEASES if r.name == name]
    return compare(release, REPO / "configs")


@pytest.mark.parametrize("release, hand", [
    ("DeepSeek-V3", _deepseek_v3), ("Mixtral 8x7B", _mixtral), ("GLM-4.5", _glm4_5),
    ("GPT-OSS-120b", _gpt_oss)])
def test_recipe_counts(release, hand):
    """Each shipped recipe's total (multi-token prediction included) and active count (all but
    the routed experts a token skips) equal the architecture's parameters by hand."""
    counts = _compared(release).counts
    assert (counts.total, counts.active) == hand()


RELEASE_NAMES = ["DeepSeek-V3", "DeepSeek-V3 as released", "Kimi-K2", "GLM-4.5", "GLM-4.5-Air",
                 "MiniMax-M2", "GPT-OSS-120b", "GPT-OSS-20b", "Mixtral 8x7B"]


@pytest.mark.parametrize("name", RELEASE_NAMES)
def test_published_counts(name):
    """The planner counts each released model's structure within 2 % of its published total
    and active count, counting the parts each figure counts (docs/memory_planner.md)."""
    compared = _compared(name)
    assert abs(compared.total_error) < 0.02 and abs(compared.active_error) < 0.02, (
        compared.total, compared.release.total, compared.active, compared.release.active)


@pytest.mark.parametrize("argv, expected", [
    (["--model", "GPT-5"], "--model 'GPT-5' is not a released model here"),
    (["--tolerance", "2"], "--tolerance 2.0 must be in (0, 1)")])
def test_bench_parameter_counts_errors(capsys, argv, expected):
    from megamoe.errors import run_cli

    with pytest.raises(SystemExit) as exit_:
        run_cli(tool_module("bench_parameter_counts").main, argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: ") and expected in err
    assert "\n" not in err


TINY_GPT_OSS = ["model.first_k_dense=0", "model.add_qkv_bias=true", "model.add_bias_linear=true",
                "model.attention_sinks=true", "model.sliding_window=8",
                "model.sliding_window_layers=[1,0,1,0]", "model.qk_layernorm=true",
                "model.qk_layernorm_scope=projection", "moe.router.bias=true",
                "moe.experts.bias=true", "moe.experts.activation=clamped_swiglu"]
TINY_GLM = ["model.mtp_layers=2", "model.share_embeddings=true", "model.qk_layernorm=true",
            "moe.shared_expert.ffn_hidden_size=64"]
TINY_LATENT = ["moe.experts.latent_size=32"]


@pytest.mark.parametrize("overrides", [TINY_GPT_OSS, TINY_GLM, TINY_LATENT],
                         ids=["gpt_oss", "glm_mtp", "latent"])
def test_counts_by_part(overrides):
    """Embedding, output layer, multi-token-prediction depths and the routed experts a token
    skips, counted on the tiny config's build, against the architecture by hand (4 layers,
    h 128, 4 heads of 32, 2 key-value groups, 8 experts of 128, top-2, vocabulary 1024)."""
    from megamoe.plan.counts import ParameterCounts, parameter_counts
    from megamoe.train.config import load_config

    config = load_config(REPO / "configs/tiny_cpu.yaml", ["parallel.expert=1", *overrides])
    counts = parameter_counts(config, 1024)
    h, E, k, V = 128, 8, 2, 1024
    if overrides is TINY_GPT_OSS:
        attention = _attention(h, 4, 2, 32, True, True, True, "projection") + h
        expert = 3 * h * 128 + 2 * 128 + h
        layer = attention + E * expert + E * h + E
        assert counts == ParameterCounts(total=2 * V * h + 4 * layer + h, embedding=V * h,
                                         output=V * h, mtp=0, mtp_depths=0,
                                         inactive=4 * (E - k) * expert, mtp_inactive=0)
        return
    if overrides is TINY_LATENT:  # experts 32 wide, between two h x 32 projections
        attention = _attention(h, 4, 2, 32) + h
        expert = 3 * 32 * 128
        moe = attention + E * expert + 2 * h * 32 + E * h
        assert counts == ParameterCounts(
            total=2 * V * h + (attention + 3 * h * 512) + 3 * moe + h, embedding=V * h,
            output=V * h, mtp=0, mtp_depths=0, inactive=3 * (E - k) * expert, mtp_inactive=0)
        return
    attention = _attention(h, 4, 2, 32, qk_norm="head") + h
    expert = 3 * h * 128
    moe = attention + E * expert + 3 * h * 64 + E * h
    main = V * h + (attention + 3 * h * 512) + 3 * moe + h
    assert counts == ParameterCounts(total=main + 2 * _mtp_depth(h, moe), embedding=V * h,
                                     output=0, mtp=2 * _mtp_depth(h, moe), mtp_depths=2,
                                     inactive=3 * (E - k) * expert,
                                     mtp_inactive=2 * (E - k) * expert)
    assert counts.with_mtp_copies == counts.total + 2 * V * h


def test_latent_rows_are_planned_at_the_latent_width():
    """A latent layer's routed rows cost what a full-width layer of the latent size's cost,
    plus its two latent-wide activations (projected tokens, combined output)."""
    from megamoe import MoEConfig
    from megamoe.plan.activations import Shapes, _moe

    def terms(**tree):
        cfg = MoEConfig.from_dict({"num_experts": 8, "ffn_hidden_size": 64, "topk": 2, **tree})
        return {t.name: t.bytes for t in _moe(cfg, Shapes(s=128, b=2, h=256, tp=1, ep=2, e=2,
                                                          vocab=1024), 0.1)}

    latent = terms(hidden_size=256, experts={"latent_size": 32})
    narrow = terms(hidden_size=32)
    projections = latent.pop("latent projections: projected tokens, combined latent output")
    assert latent == narrow and projections == 2 * 256 * 32 * 2


def test_stage_state_bytes_by_hand():
    """Pipeline stage 0 of the tiny config at TP2 x PP2 x EP2 x DP2 (8 ranks), fp32: layer 0
    dense, layer 1 MoE; the distributed optimizer shards Adam's moments over DP (dense) and
    expert DP; fp32 parameters are their own main weights."""
    from megamoe.plan.layouts import Layout, with_layout
    from megamoe.plan.shards import build_stage
    from megamoe.train.config import load_config

    layout = Layout(8, tensor=2, pipeline=2, expert=2)
    config = with_layout(load_config(REPO / "configs/tiny_cpu.yaml"), layout)
    shard = build_stage(config, layout, 0, bf16=False, vocab_size=4096)
    h, tp, d, heads, groups, E, ep = 128, 2, 32, 4, 2, 8, 2
    attention = (h * heads * d + 2 * h * groups * d + heads * d * h) // tp + 2 * h
    dense = 4096 * h // tp + attention + 3 * h * 512 // tp
    moe_rest = attention + E * h + 0  # router (replicated over tensor ranks)
    experts = (E // ep) * 3 * h * 128
    assert shard.parameters == dense + moe_rest + experts
    assert shard.expert_parameters == experts
    elements = dense + moe_rest + experts
    state = shard.state_bytes
    # DDP buffers pad each bucket to a multiple of lcm(DP, 128) elements.
    assert 4 * elements <= state["parameters"] <= 4 * elements * 1.01
    assert state["gradients"] == state["parameters"]
    adam = 8 * ((dense + moe_rest) / layout.data + experts / layout.expert_data)
    assert adam <= state["optimizer"] <= adam * 1.01 + 1024
    assert [layer.number for chunk in shard.chunks for layer in chunk.layers] == [1, 2]


def test_muon_state_per_rank_by_hand():
    """Muon's state on the tiny config at DP2, fp32: replicated, every rank holds Muon's
    momentum (4 bytes per element of the linear and expert weights) and step count (a 4-byte
    scalar per weight) and Adam's two moments (8 bytes per element of embeddings, output
    layer, norms and routers); distributed
    (`optimizer.muon.distributed`), data-parallel rank 0 holds about half."""
    from megamoe.plan.layouts import Layout, with_layout
    from megamoe.plan.shards import build_stage
    from megamoe.train.config import load_config

    layout = Layout(2, expert=1)
    h, E, layers, moe_layers = 128, 8, 4, 3
    attention = h * (4 * 32 + 2 * 2 * 32) + 4 * 32 * h  # QKV and output projection
    muon = layers * attention + 3 * 512 * h + moe_layers * E * 3 * h * 128
    adam = 2 * 4096 * h + layers * 2 * h + h + moe_layers * E * h  # embeddings, norms, routers
    muon_weights = layers * 2 + 2 + moe_layers * 2
    state = {}
    for distributed in (False, True):
        config = with_layout(load_config(REPO / "configs/tiny_cpu.yaml", [
            "optimizer.name=muon", f"optimizer.muon.distributed={str(distributed).lower()}"]),
            layout)
        shard = build_stage(config, layout, 0, bf16=False, vocab_size=4096)
        state[distributed] = shard.state_bytes["optimizer"]
    assert state[False] == 4 * muon + 4 * muon_weights + 8 * adam
    assert 0.45 * state[False] <= state[True] <= 0.55 * state[False]


@pytest.mark.parametrize("first_k_dense, tensors", [(0, [1, 2, 4]), (1, [1])])
def test_layouts_follow_the_trainers_config_check(first_k_dense, tensors):
    """The planner offers the tensor sizes the trainer accepts: a dense MLP 129 wide (odd)
    rules out tensor 2 and 4 when a layer is dense, and nothing when every layer is MoE."""
    from megamoe.plan.layouts import layouts_of_world
    from megamoe.train.config import config_from_dict

    config = config_from_dict({"moe": {"num_experts": 8, "ffn_hidden_size": 8},
                               "model": {"ffn_hidden_size": 129, "first_k_dense": first_k_dense},
                               "training": {"micro_batch_size": 1, "global_batch_size": 4}})
    offered = sorted({layout.tensor for layout, _ in layouts_of_world(config, 4)})
    assert offered == tensors


def test_schedule_in_flight():
    """1F1B holds P - p micro-batches at stage p (capped by their number); interleaved
    2 (P - p - 1) + (v - 1) P + 1 chunk micro-batches (Megatron-Core's schedules)."""
    from megamoe.plan.schedule import in_flight, peak

    assert [in_flight(8, 1, 4, p) for p in range(4)] == [4, 3, 2, 1]
    assert in_flight(2, 1, 4, 0) == 2
    assert in_flight(1, 1, 1, 0) == 1
    assert [in_flight(8, 2, 4, p) for p in range(4)] == [11, 9, 7, 5]
    one = {"a": 1.0}
    assert peak([one], [{"a": 0.0}], 8, 4, 0) == {"a": 4.0}
    assert peak([one, {"a": 10.0}], [{"a": 0.0}] * 2, 8, 2, 1) == {"a": 12.0}
    # A backward's recomputation adds on top of what is alive.
    assert peak([one], [{"a": 5.0}], 3, 1, 0) == {"a": 6.0}


@pytest.mark.parametrize("tokens, experts, topk, local, maxvio",
                         [(32, 4, 2, 2, 1.0), (32, 8, 2, 4, 3.0), (32, 8, 2, 4, 0.0),
                          (100, 16, 4, 16, 0.5), (64, 8, 2, 2, 1.0)])
def test_forced_routing(tokens, experts, topk, local, maxvio):
    from megamoe.plan.activations import routed_rows
    from megamoe.plan.measure import forced_loads, forced_map, maxvio_of
    from megamoe.config import MoEConfig

    loads = forced_loads(tokens, experts, topk, local, maxvio)
    map_TE = forced_map(tokens, loads)
    assert map_TE.sum(0).tolist() == loads
    assert (map_TE.sum(1) == topk).all()  # every token k distinct experts
    assert maxvio_of(loads) == pytest.approx(maxvio, abs=0.05)
    # The busiest rank (experts 0..local-1) receives the plan's bound, from one source rank.
    cfg = MoEConfig(hidden_size=8, num_experts=experts, ffn_hidden_size=8, topk=topk)
    ep = experts // local
    assert sum(loads[:local]) * ep == pytest.approx(routed_rows(cfg, tokens, ep, maxvio)[1],
                                                    rel=0.05)


@pytest.fixture(scope="module")
def tool():
    return tool_module("plan_memory")


def test_json_schema(tool, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert tool.main(["--config", str(REPO / "configs/tiny_cpu.yaml"), "--ranks", "2",
                      "--device-memory", "1GiB", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["total_parameters"] > data["active_parameters"] > 0
    categories = ["parameters", "gradients", "optimizer", "activations", "moe_dispatch"]
    assert data["categories"] == categories
    assert {(e["rank"], e["category"]) for e in data["entries"]} == {
        (r, c) for r in range(2) for c in categories}
    assert all(isinstance(e["bytes"], int) and e["bytes"] >= 0 for e in data["entries"])
    (layout,) = data["layouts"]
    assert layout["world"] == 2 and layout["data"] == 2 and layout["fits"] is True
    assert layout["num_microbatches"] == 1
    printed = capsys.readouterr().out
    assert "TP1 PP1 EP2 DP2" in printed and "total" in printed


@pytest.mark.parametrize("argv, expected", [
    (["--config", "configs/tiny_cpu.yaml", "model.num_layerz=2"], "model.num_layers"),
    (["--config", "configs/tiny_cpu.yaml", "--device-memory", "80 gigs"], "--device-memory"),
    (["--config", "configs/tiny_cpu.yaml", "--world", "0"], "--world 0"),
    (["--config", "configs/tiny_cpu.yaml", "--world", "3"], "--world 3"),
    (["--config", "configs/tiny_cpu.yaml", "--maxvio", "-1"], "--maxvio"),
    (["--config", "configs/tiny_cpu.yaml", "--world", "2", "--top", "0"],
     "argument --top: 0 must be >= 1"),
    (["--config", "configs/tiny_cpu.yaml", "--ranks", "4"], "--ranks 4"),
    (["--config", "configs/tiny_cpu.yaml", "--ranks", "3"], "--ranks 3"),
    (["--config", "configs/missing.yaml"], "missing.yaml"),
    # sizes beyond the largest model: refused when the config loads (megamoe.train.settings.sizes)
    (["--config", "configs/tiny_cpu.yaml", "model.seq_length=1000000000000"],
     "model.seq_length=1000000000000 is beyond the largest model megamoe builds"),
    (["--config", "configs/tiny_cpu.yaml", "moe.num_experts=1000000"],
     "moe.num_experts=1000000 is beyond"),
    (["--config", "configs/tiny_cpu.yaml", "model.num_layers=8", "model.first_k_dense=0",
      "moe.num_experts=65536", "parallel.expert=1"], "524,288 routed experts"),
])
def test_cli_errors(tool, tmp_path, capsys, monkeypatch, argv, expected):
    from megamoe.errors import run_cli

    monkeypatch.chdir(REPO)
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as exit_:
        run_cli(tool.main, argv + ["--json", str(out), "--png", str(tmp_path / "plan.png")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    assert err.startswith("error: ") and expected in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_long_sequence_is_planned_without_its_attention_mask(tmp_path):
    """seq_length 2^16: the CPU causal mask the trainer's engine builds would hold 4 GiB; the
    planner builds it on the meta device, so the whole plan stays far below that."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import resource, runpy, sys; sys.argv = sys.argv[1:]\n"
         "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
         "finally:\n    print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
         str(REPO / "tools" / "plan_memory.py"), "--config", "configs/tiny_cpu.yaml",
         "model.seq_length=65536"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    peak_kib = int(done.stdout.rsplit("maxrss_kib", 1)[1])
    assert peak_kib < 2 * 2**20, peak_kib  # the mask alone: 4 GiB
