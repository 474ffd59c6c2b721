"""Upcycle dense checkpoints made by Megatron-Core (torch_dist and legacy, TP=1) and load the
results into Megatron-Core's own MoE GPTModel: logits must match the dense model's."""
import argparse

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import upcycle_ckpts as ck
from tiny_models import build_gpt
from megamoe.checkpointing.readers import open_dense_checkpoint
from megamoe.megatron.moe_module import MegatronMoELayer
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.upcycle import UpcycleRecipe, upcycle_checkpoint

TOL = 1e-4
LAYERS = 4
FFN = 128  # tiny_transformer_config's ffn_hidden_size


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """Dense GLU (4 layers) and plain GELU (2 layers) models, their logits and checkpoints."""
    setup_megatron(seed=11)
    root = tmp_path_factory.mktemp("dense")
    models = {}
    for name, style, layers in (("glu", ck.GLU, LAYERS), ("plain", ck.PLAIN, 2)):
        cfg = ck.config(style, num_layers=layers)
        model = ck.build(cfg)
        args = ck.megatron_lm_args(cfg)
        models[name] = dict(
            model=model, style=style, logits=ck.logits(model, ck.tokens()),
            torch_dist=ck.save_torch_dist(model, root / f"{name}_dist", args),
            legacy=ck.save_legacy(model, root / f"{name}_legacy", args))
    yield models
    teardown_megatron()


def upcycle(source, tmp_path, **recipe):
    return upcycle_checkpoint(source, tmp_path / "moe", UpcycleRecipe(**recipe), progress=False,
                              log=lambda line: None)


def moe_logits(dense_entry, result, settings, metadata=None, layers=LAYERS):
    cfg = ck.moe_config(dense_entry["style"], layers, settings)
    model = ck.load_dist(ck.build(cfg), result.checkpoint_dir, metadata)
    return model, ck.logits(model, ck.tokens())


def max_diff(a, b):
    return float((a - b).abs().max())


def dense_mlp_weights(model, layer):
    mlp = model.decoder.layers[layer].mlp
    return mlp.linear_fc1.weight, mlp.linear_fc2.weight


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_sparse_copy_matches_dense_logits(dense, tmp_path, fmt):
    glu = dense["glu"]
    result = upcycle(glu[fmt], tmp_path, num_experts=4, topk=2)
    model, logits = moe_logits(glu, result, dict(num_moe_experts=4, moe_router_topk=2))
    assert max_diff(logits, glu["logits"]) <= TOL
    fc1, fc2 = dense_mlp_weights(glu["model"], 2)
    for expert in model.decoder.layers[2].mlp.experts.local_experts:
        assert torch.equal(expert.linear_fc1.weight, fc1)
        assert torch.equal(expert.linear_fc2.weight, fc2)
    assert result.record["source"]["format"] == fmt
    assert result.record["recipe"]["num_experts"] == 4


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
@pytest.mark.parametrize("topk", [2, 4])
def test_granular_virtual_groups_match_dense_logits(dense, tmp_path, fmt, topk):
    glu = dense["glu"]
    result = upcycle(glu[fmt], tmp_path, num_experts=8, topk=topk, granularity=2)
    model, logits = moe_logits(glu, result, dict(num_moe_experts=8, moe_router_topk=topk,
                                                 moe_ffn_hidden_size=FFN // 2))
    assert max_diff(logits, glu["logits"]) <= TOL
    router = model.decoder.layers[0].mlp.router.weight
    assert torch.equal(router[0], router[1]) and not torch.equal(router[1], router[2])


def test_granular_plain_gelu_mlp(dense, tmp_path):
    plain = dense["plain"]
    result = upcycle(plain["torch_dist"], tmp_path, num_experts=4, topk=2, granularity=2)
    _, logits = moe_logits(plain, result, dict(num_moe_experts=4, moe_router_topk=2,
                                               moe_ffn_hidden_size=FFN // 2), layers=2)
    assert max_diff(logits, plain["logits"]) <= TOL
    assert result.record["gated"] is False and result.record["activation"] == "gelu"


@pytest.mark.parametrize("moe_layers,freq", [((1, 3), [0, 1, 0, 1]), (2, 2), ((0, 1, 2, 3),
                                                                          [1, 1, 1, 1])])
def test_mixed_dense_and_moe_layers(dense, tmp_path, moe_layers, freq):
    glu = dense["glu"]
    result = upcycle(glu["legacy"], tmp_path, num_experts=4, topk=2, moe_layers=moe_layers)
    model, logits = moe_logits(glu, result, dict(num_moe_experts=4, moe_router_topk=2,
                                                 moe_layer_freq=freq))
    assert max_diff(logits, glu["logits"]) <= TOL
    assert result.record["key_layout"] == "per_layer"
    moe = [hasattr(layer.mlp, "router") for layer in model.decoder.layers]
    assert moe == [bool(f) for f in (freq if isinstance(freq, list) else [1, 0, 1, 0])]
    dense_layer = moe.index(False) if False in moe else None
    if dense_layer is not None:
        fc1, _ = dense_mlp_weights(glu["model"], dense_layer)
        assert torch.equal(model.decoder.layers[dense_layer].mlp.linear_fc1.weight, fc1)


def test_shared_expert_from_the_dense_mlp(dense, tmp_path):
    glu = dense["glu"]
    result = upcycle(glu["torch_dist"], tmp_path, num_experts=8, topk=2, granularity=2,
                     shared_expert=True)
    _, logits = moe_logits(glu, result, dict(num_moe_experts=8, moe_router_topk=2,
                                             moe_ffn_hidden_size=FFN // 2,
                                             moe_shared_expert_intermediate_size=FFN))
    assert max_diff(logits, glu["logits"]) <= TOL


def test_sigmoid_router_with_expert_bias(dense, tmp_path):
    glu = dense["glu"]
    result = upcycle(glu["torch_dist"], tmp_path, num_experts=4, topk=2,
                     score_function="sigmoid")
    model, logits = moe_logits(glu, result, dict(
        num_moe_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True))
    assert max_diff(logits, glu["logits"]) <= TOL
    assert not model.decoder.layers[1].mlp.router.expert_bias.any()


def test_softmax_before_selection_with_zero_router(dense, tmp_path):
    glu = dense["glu"]
    result = upcycle(glu["torch_dist"], tmp_path, num_experts=4, topk=2, pre_softmax=True,
                     router_init="zero")
    _, logits = moe_logits(glu, result, dict(num_moe_experts=4, moe_router_topk=2,
                                             moe_router_pre_softmax=True))
    assert max_diff(logits, glu["logits"]) <= TOL


def test_singleton_key_layout(dense, tmp_path):
    glu = dense["glu"]
    result = upcycle(glu["torch_dist"], tmp_path, num_experts=4, topk=2, key_layout="singleton")
    _, logits = moe_logits(glu, result, dict(num_moe_experts=4, moe_router_topk=2),
                           metadata={"singleton_local_shards": True})
    assert max_diff(logits, glu["logits"]) <= TOL


def test_drop_upcycling_changes_half_of_each_expert(dense, tmp_path):
    glu = dense["glu"]
    result = upcycle(glu["legacy"], tmp_path, num_experts=4, topk=2, drop_ratio=0.5)
    model, logits = moe_logits(glu, result, dict(num_moe_experts=4, moe_router_topk=2))
    assert max_diff(logits, glu["logits"]) > 1e-3
    _, fc2 = dense_mlp_weights(glu["model"], 0)
    changed = [set(torch.nonzero((e.linear_fc2.weight != fc2).any(0)).flatten().tolist())
               for e in model.decoder.layers[0].mlp.experts.local_experts]
    assert all(len(c) == FFN // 2 for c in changed) and len({frozenset(c) for c in changed}) == 4
    assert result.record["function_preserving"] is False


def test_reading_args_keeps_megatrons_safe_globals(dense):
    """Megatron registers Namespace for weights_only loads on import; reading a checkpoint's
    args must not unregister it (Megatron's own loader reads the same common.pt)."""
    assert argparse.Namespace in torch.serialization.get_safe_globals()
    for fmt in ("torch_dist", "legacy"):
        source = open_dense_checkpoint(dense["glu"][fmt])
        assert source.args.num_attention_heads == ck.HEADS
    assert argparse.Namespace in torch.serialization.get_safe_globals()


def test_te_target_moves_the_pre_mlp_norm(dense, tmp_path):
    result = upcycle(dense["glu"]["torch_dist"], tmp_path, num_experts=4, topk=2,
                     target_spec="te")
    keys = set(FileSystemReader(result.checkpoint_dir).read_metadata().state_dict_metadata)
    assert "decoder.layers.pre_mlp_layernorm.weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" not in keys


@pytest.mark.parametrize("fmt,moe_layers", [("torch_dist", "all"), ("legacy", (1, 3))])
def test_verify_reports_the_logit_difference(dense, tmp_path, fmt, moe_layers):
    glu = dense["glu"]
    lines = []
    result = upcycle_checkpoint(glu[fmt], tmp_path / "moe", UpcycleRecipe(
        num_experts=8, topk=2, granularity=2, moe_layers=moe_layers), verify=True,
        progress=False, log=lines.append)
    assert result.max_logit_diff <= TOL and any("max |logit diff|" in line for line in lines)
    dropped = upcycle_checkpoint(glu[fmt], tmp_path / "drop", UpcycleRecipe(
        num_experts=4, topk=2, drop_ratio=0.5), verify=True, progress=False, log=lines.append)
    assert dropped.max_logit_diff > 1e-3  # reported, not enforced


@pytest.mark.parametrize("moe_layers,freq", [("all", 1), ((1, 2, 3), [0, 1, 1, 1])])
def test_upcycled_checkpoint_loads_into_megamoe_model(dense, tmp_path, moe_layers, freq):
    from megamoe.megatron.specs import gpt_decoder_block_spec

    glu = dense["glu"]
    result = upcycle(glu["torch_dist"], tmp_path, num_experts=8, topk=2, granularity=2,
                     moe_layers=moe_layers, shared_expert=True)
    cfg = ck.config(ck.GLU, num_layers=LAYERS, num_moe_experts=8, moe_router_topk=2,
                    moe_ffn_hidden_size=FFN // 2, moe_layer_freq=freq,
                    moe_shared_expert_intermediate_size=FFN)
    model = build_gpt(cfg, gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                      vocab_size=ck.VOCAB, seq_len=ck.SEQ).eval()
    assert sum(isinstance(m, MegatronMoELayer) for m in model.modules()) == sum(
        result.record["moe_layer_pattern"])
    ck.load_dist(model, result.checkpoint_dir)
    assert max_diff(ck.logits(model, ck.tokens()), glu["logits"]) <= TOL
