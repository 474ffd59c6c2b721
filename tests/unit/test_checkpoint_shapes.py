"""Whether a checkpoint's weights fit the run's model (megamoe.train.checkpoint_shapes) and
which vocabulary shapes a load accepts (megamoe.checkpointing.safe_dcp): the verdict on each
changed setting is held against the tensors of the two models Megatron-Core builds, and a
refusal names the setting that was changed."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from megamoe import CheckpointError

PATH = Path("ckpt/iter_0000002")
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
# change -> the setting a refusal names (None: the same tensors, the weights load)
CHANGES = [
    ({"model": {"num_layers": 3}}, "model.num_layers"),
    ({"model": {"first_k_dense": 2}}, "model.first_k_dense"),
    ({"model": {"moe_layer_freq": 2}}, "model.moe_layer_freq"),
    ({"model": {"hidden_size": 64}}, "model.hidden_size"),
    ({"model": {"num_query_groups": 2}}, "model.num_query_groups"),
    ({"model": {"ffn_hidden_size": 32}}, "model.ffn_hidden_size"),
    ({"model": {"normalization": "LayerNorm"}}, "model.normalization"),
    ({"model": {"share_embeddings": True}}, "model.share_embeddings"),
    ({"model": {"seq_length": 64}}, "model.seq_length"),  # learned absolute positions
    ({"moe": {"ffn_hidden_size": 16}}, "moe.ffn_hidden_size"),
    ({"moe": {"num_experts": 8}}, "moe.num_experts"),
    ({"moe": {"shared_expert": {"ffn_hidden_size": 16}}}, "moe.shared_expert.ffn_hidden_size"),
    ({"moe": {"shared_expert": {"gate": True}}}, "moe.shared_expert.gate"),
    ({"moe": {"experts": {"activation": "gelu"}}}, "moe.experts.activation"),
    ({"moe": {"experts": {"bias": True}}}, "moe.experts.bias"),
    ({"moe": {"router": {"bias": True}}}, "moe.router.bias"),
    ({"moe": {"experts": {"activation": "clamped_swiglu", "swiglu_limit": 3.0}}}, None),
    ({"moe": {"layer_overrides": {2: {"num_experts": 8}}}}, "moe.layer_overrides.2.num_experts"),
    ({"moe": {"layer_overrides": {2: {"experts": {"activation": "gelu"}}}}},
     "moe.layer_overrides.2.experts.activation"),
    ({"moe": {"topk": 1}}, None),
    ({"moe": {"router": {"score_function": "softmax"}, "balancing": {"methods": "aux_loss"}}},
     None),
    ({"moe": {"layer_overrides": {2: {"topk": 1}}}}, None),
    ({"model": {"moe_layer_freq": [0, 1, 1, 1]}}, None),  # the pattern first_k_dense=1 gives
    ({"model": {"hidden_dropout": 0.1, "rotary_base": 500}}, None),
    # another padding of the vocabulary: the load adds or drops padding rows
    ({"model": {"make_vocab_size_divisible_by": 48}}, None),
]


@pytest.fixture(scope="module")
def megatron():
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron

    setup_megatron(seed=3)
    yield
    teardown_megatron()


def _config(change: dict):
    """A tiny GPT-MoE (a dense first layer, a shared expert) with `change` applied."""
    from megamoe.settings import deep_merge
    from megamoe.train.config import config_from_dict

    raw = {"model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                     "ffn_hidden_size": 64, "seq_length": 32, "first_k_dense": 1},
           "moe": {"num_experts": 4, "ffn_hidden_size": 32, "topk": 2,
                   "router": {"score_function": "sigmoid"}, "balancing": {"methods": "bias"},
                   "shared_expert": {"ffn_hidden_size": 32}}}
    return config_from_dict(deep_merge(raw, change))


def _tensor_shapes(config) -> dict:
    """Every tensor of the model Megatron-Core builds for `config` with its shape (the
    vocabulary tensors' without their rows: how many are padding depends on the layout), but
    the expert biases, which a load may start at zero (loss-free balancing switched on)."""
    from megamoe.train.model import build_model, transformer_config

    (model,) = build_model(config, transformer_config(config, False, False), 512)
    return {key: tuple(value.shape)[1 if key.endswith(VOCAB) else 0:]
            for key, value in model.state_dict().items()
            if not key.endswith(("_extra_state", "expert_bias"))}


def _common(config) -> dict:
    from megamoe.train.checkpoint_schema import FORMAT_VERSION

    return {"format_version": FORMAT_VERSION,
            "train_state": {"iteration": 2, "consumed_samples": 8},
            "layout": {"world_size": 1}, "config": config.to_dict()}


@pytest.mark.parametrize("change, setting", CHANGES, ids=lambda v: json.dumps(v)[:50])
def test_the_verdict_is_whether_megatron_builds_other_tensors(megatron, change, setting):
    from megamoe.train.checkpoint_shapes import check_weights_fit

    saved, run = _config({}), _config(change)
    other_tensors = _tensor_shapes(saved) != _tensor_shapes(run)
    assert other_tensors == (setting is not None)
    if setting is None:
        check_weights_fit(_common(saved), run, PATH)
        return
    with pytest.raises(CheckpointError) as refused:
        check_weights_fit(_common(saved), run, PATH)
    message = str(refused.value)
    assert "\n" not in message and str(PATH) in message
    assert f"holds a model with {setting}=" in message and f"set {setting}=" in message


def test_a_converters_model_sections_are_compared_and_megatron_lm_args_too(capsys):
    from megamoe.train.checkpoint_shapes import check_weights_fit

    saved, run = _config({}), _config({"moe": {"num_experts": 8}})
    sections = {key: saved.to_dict()[key] for key in ("model", "moe")}
    with pytest.raises(CheckpointError, match="moe.num_experts=4 but this run's config says 8"):
        check_weights_fit({"megamoe_model": sections, "iteration": 0}, run, PATH)
    # An older converter wrote its MoE settings flat: read as the same tree, without the
    # notes a flat key of a user's config prints.
    flat = {"num_experts": 4, "ffn_hidden_size": 32, "topk": 2, "score_function": "sigmoid",
            "balancing": "bias", "shared_expert_ffn_size": 32}
    older = {"megamoe_model": {"model": sections["model"], "moe": flat}, "iteration": 0}
    check_weights_fit(older, saved, PATH)
    with pytest.raises(CheckpointError, match="moe.shared_expert.ffn_hidden_size=32 but this "
                                              "run's config says 16"):
        check_weights_fit(older, _config({"moe": {"shared_expert": {"ffn_hidden_size": 16}}}),
                          PATH)
    assert "note:" not in capsys.readouterr().err
    args = argparse.Namespace(num_layers=4, hidden_size=32, num_attention_heads=4,
                              ffn_hidden_size=64, num_experts=4, moe_ffn_hidden_size=32)
    megatron_lm = {"args": args, "checkpoint_version": 3.0, "iteration": 0}
    check_weights_fit(megatron_lm, saved, PATH)
    with pytest.raises(CheckpointError, match="num_experts=4 but the config says "
                                              "moe.num_experts=8"):
        check_weights_fit(megatron_lm, run, PATH)
    with pytest.raises(CheckpointError, match="moe_ffn_hidden_size=32 but the config says "
                                              "moe.ffn_hidden_size=16"):
        check_weights_fit(megatron_lm, _config({"moe": {"ffn_hidden_size": 16}}), PATH)
    check_weights_fit({"iteration": 0}, run, PATH)  # records nothing: the load decides


@pytest.mark.parametrize("sections", [None, "model", {"model": {}, "moe": 3},
                                      {"model": {"num_layers": "four"}, "moe": {}}])
def test_malformed_model_settings_are_a_corrupt_checkpoint(sections):
    from megamoe.train.checkpoint_shapes import check_weights_fit

    common = {"format_version": 1, "train_state": {"iteration": 2, "consumed_samples": 8},
              "layout": {"world_size": 1}, "config": sections}
    with pytest.raises(CheckpointError) as refused:
        check_weights_fit(common, _config({}), PATH)
    assert "\n" not in str(refused.value) and str(PATH) in str(refused.value)


def _shapes_check(saved_rows: int, rows: int, vocab_size, key: str = VOCAB[0], width: int = 8,
                  saved_width: int = 8) -> None:
    """safe_dcp's check of a request for `key` with `rows` rows against a checkpoint that
    saved `saved_rows`, as Megatron-Core marks the vocabulary tensors (allow_shape_mismatch)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint.metadata import (Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    from megamoe.checkpointing.safe_dcp import _check_global_shapes

    tensor = ShardedTensor.from_rank_offsets(key, torch.zeros(rows, width), replica_id=0)
    tensor.allow_shape_mismatch = key.endswith(VOCAB)
    saved = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                  torch.Size([saved_rows, saved_width]), [])
    _check_global_shapes({"w": tensor}, Metadata({key: saved}), PATH, vocab_size)


@pytest.mark.parametrize("saved_rows, rows", [(384, 512), (512, 384), (384, 384)])
def test_vocabulary_rows_may_differ_in_their_padding(saved_rows, rows):
    _shapes_check(saved_rows, rows, 360)
    _shapes_check(saved_rows, rows, 360, key=f"optimizer.state.exp_avg.{VOCAB[1]}")


def test_rows_of_real_tokens_must_be_in_the_checkpoint_and_other_shapes_match():
    with pytest.raises(CheckpointError, match=r"\(384, 8\), this run's model \(512, 8\) \(384 "
                                              r"rows, fewer than the 400 tokens"):
        _shapes_check(384, 512, 400)
    with pytest.raises(CheckpointError, match=r"a vocabulary of 384: train with"):
        _shapes_check(384, 512, None)  # without the tokenizer the rows must agree
    with pytest.raises(CheckpointError, match=r"\(384, 16\), this run's model \(384, 8\); make"):
        _shapes_check(384, 384, 360, saved_width=16)
    with pytest.raises(CheckpointError, match=r"decoder.w holds|holds decoder.w"):
        _shapes_check(384, 512, 360, key="decoder.w")
