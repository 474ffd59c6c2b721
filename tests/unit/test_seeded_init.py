"""Layout-invariant initialisation (`megamoe.megatron.seeded_init`): any shard of a full tensor's
stream is exactly that slice of the stream written out block by block (the reference below
restates the definition with one generator per block), a rank generates only its blocks, and the
trainer's model gets Megatron's own distributions (its init methods' stds, constant norms and
biases). The layout suite (`tests/distributed/test_layouts.py`) trains every layout from the seed
alone against one process."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from megamoe.megatron import seeded_init
from megamoe.megatron.seeded_init import BLOCK_ELEMENTS, block_seed, full_tensor_slice

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))


def naive_full_tensor(seed, key, unit, shape):
    """The definition: rows cut in blocks of BLOCK_ELEMENTS // row size, each block its own
    generator seeded by block_seed."""
    row = math.prod(shape[1:])
    per_block = max(1, BLOCK_ELEMENTS // row)
    blocks = [torch.randn((min(per_block, shape[0] - lo), *shape[1:]),
                          generator=torch.Generator().manual_seed(block_seed(seed, key, unit, b)))
              for b, lo in enumerate(range(0, shape[0], per_block))]
    return torch.cat(blocks)


@pytest.mark.parametrize("shape", [(4096, 1000), (50, 7), (3 * 2**20 + 5,), (9, 4, 6)])
@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("axis", [0, 1])
def test_every_shard_is_its_slice_of_the_full_stream(shape, parts, axis):
    if axis >= len(shape):
        pytest.skip("1-D tensor")
    full = naive_full_tensor(5, "decoder.layers.mlp.linear_fc1.weight", (2,), shape)
    bounds = [round(i * shape[axis] / parts) for i in range(parts + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        index = tuple(slice(lo, hi) if d == axis else slice(0, n) for d, n in enumerate(shape))
        got = full_tensor_slice(5, "decoder.layers.mlp.linear_fc1.weight", (2,), shape, index)
        torch.testing.assert_close(got, full[index], rtol=0, atol=0)


def test_streams_differ_by_seed_key_and_unit():
    shape, index = (8, 8), (slice(0, 8), slice(0, 8))
    base = full_tensor_slice(1, "a.weight", (0,), shape, index)
    for other in (full_tensor_slice(2, "a.weight", (0,), shape, index),
                  full_tensor_slice(1, "b.weight", (0,), shape, index),
                  full_tensor_slice(1, "a.weight", (1,), shape, index)):
        assert not torch.equal(base, other)


def test_a_row_shard_generates_only_its_blocks(monkeypatch):
    """A quarter of the rows of a 64 Mi-element tensor draws about a quarter of it (its rows
    plus at most one partial block at each end), never the whole tensor."""
    drawn = []
    randn = torch.randn

    def counting(size, **kwargs):
        drawn.append(math.prod(size))
        return randn(size, **kwargs)

    monkeypatch.setattr(seeded_init.torch, "randn", counting)
    shape = (16384, 4096)
    rows = slice(8192 + 100, 12288 + 100)
    got = full_tensor_slice(0, "output_layer.weight", (), shape, (rows, slice(0, 4096)))
    assert got.shape == (4096, 4096)
    assert sum(drawn) <= 4096 * 4096 + 2 * BLOCK_ELEMENTS
    assert max(drawn) <= BLOCK_ELEMENTS


@pytest.fixture(scope="module")
def megatron():
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron

    setup_megatron(seed=3)
    yield
    teardown_megatron()


def test_the_trainer_model_has_megatron_distributions(megatron):
    """Every tensor of the trainer's model (GQA, QK norm, SwiGLU, dense first layer, shared
    expert): normal with the std of the init method Megatron gives it (the residual-stream
    projections scaled by 1/sqrt(2L)), norms at one, biases at zero; two builds with one seed
    equal, another seed differs."""
    import layout_workers as lw

    from megamoe.train.config import config_from_dict
    from megamoe.train.model import build_model, transformer_config

    raw = lw.config_dict({"prefixes": ["unused"], "tokenizer_model": "unused.model"}, "unused",
                         {}, sections={"model": {"swiglu": True, "qk_layernorm": True,
                                                 "num_query_groups": 2}})
    config = config_from_dict(raw)
    tc = transformer_config(config, False, False)
    (model,) = build_model(config, tc, 512)
    (again,) = build_model(config, tc, 512)
    sigma, num_layers = config.model.init_method_std, config.model.num_layers
    normals = 0
    for name, tensor in model.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0)
        if name.endswith(("norm.weight", "layer_norm_weight")):
            assert torch.all(tensor == 1), name
        elif name.endswith(("bias", "expert_bias")):
            assert torch.all(tensor == 0), name
        else:
            output = name.endswith(("linear_proj.weight", "linear_fc2.weight", "fc2_weight"))
            want = sigma / math.sqrt(2 * num_layers) if output else sigma
            n = tensor.numel()
            # The sample std of n normals is within 5 standard errors (std / sqrt(2n)).
            assert abs(float(tensor.std()) - want) <= 5 * want / math.sqrt(2 * n), name
            assert abs(float(tensor.mean())) <= 5 * want / math.sqrt(n), name
            normals += 1
    assert normals >= 20
    config = config_from_dict({**raw, "training": {**raw["training"], "seed": 99}})
    (other,) = build_model(config, tc, 512)
    key = "output_layer.weight"
    assert not torch.equal(other.state_dict()[key], model.state_dict()[key])
