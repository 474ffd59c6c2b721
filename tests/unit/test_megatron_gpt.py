"""megamoe layers inside a Megatron-Core GPTModel, on the GPU where there is one (gpu_check.sh
runs them there), else on the CPU."""
import pytest
import torch

from megamoe.balancing import step_balancing
from megamoe.balancing.owner import StepOwner
from megamoe.megatron.fields import moe_config_from_transformer_config
from tiny_models import build_gpt, tiny_transformer_config
from megamoe.megatron.masks import attention_mask_for
from megamoe.megatron.moe_module import MegatronMoELayer
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.megatron.specs import (decoder_block_spec, gpt_decoder_block_spec, layer_spec,
                                    moe_layer_pattern)

VOCAB, SEQ = 64, 16
ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture(scope="module")
def megatron():
    setup_megatron(seed=7)
    yield
    teardown_megatron()


def moe_config(**changes):
    base = dict(num_layers=3, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_layer_freq=[0, 1, 1], moe_router_enable_expert_bias=True,
                moe_router_score_function="sigmoid")
    return tiny_transformer_config(**{**base, **changes})


def lm_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (8, 1), generator=gen)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB  # learnable: next token = token + 1
    return tokens[:, :-1].to(DEVICE), tokens[:, 1:].to(DEVICE)


def gpt(config, spec):
    """A tiny GPTModel with `spec`'s layers on DEVICE."""
    return build_gpt(config, spec, vocab_size=VOCAB, seq_len=SEQ).to(DEVICE)


def lm_loss(model, tokens, labels):
    position_ids = torch.arange(SEQ, device=DEVICE).expand(tokens.shape[0], -1)
    return model(tokens, position_ids, attention_mask_for(SEQ, ON_CUDA), labels=labels).mean()


def test_gpt_with_megamoe_layers_trains_and_balances(megatron):
    """Trained by a plain loop that calls step_balancing (megamoe's trainer's owner)."""
    config = moe_config(moe_router_enable_expert_bias=False)
    moe = moe_config_from_transformer_config(config, {"balancing": {"methods": "bias"}})

    def spec():
        return gpt_decoder_block_spec(config, moe, layer_overrides={2: {"num_experts": 8}},
                                      step_owner=StepOwner.STEP_BALANCING)

    model = gpt(config, spec())
    moe_layers = [m for m in model.modules() if isinstance(m, MegatronMoELayer)]
    assert [layer.cfg.num_experts for layer in moe_layers] == [4, 8]
    assert [layer.router.layer_number for layer in moe_layers] == [2, 3]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        loss = lm_loss(model, *lm_batch(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        metrics = step_balancing(model)
        losses.append(float(loss.detach()))
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    assert {"moe/layer2/maxvio_global", "moe/layer3/maxvio_global"} <= set(metrics)
    assert all(layer.router.expert_bias.abs().sum() > 0 for layer in moe_layers)

    fresh = gpt(config, spec())
    fresh.load_state_dict(model.state_dict())
    for old, new in zip(moe_layers, [m for m in fresh.modules() if isinstance(m, MegatronMoELayer)]):
        assert torch.equal(old.router.expert_bias, new.router.expert_bias)
    model.eval(), fresh.eval()
    tokens, labels = lm_batch(99)
    with torch.no_grad():
        assert torch.equal(lm_loss(model, tokens, labels), lm_loss(fresh, tokens, labels))


def test_the_spec_carries_each_layers_object(megatron):
    """The layers are configured by the very objects the spec was given; Megatron-LM's block
    spec function maps the flags into one object that every layer holds."""
    config = moe_config()
    base = moe_config_from_transformer_config(config)
    other = base.merged({"num_experts": 8, "topk": 1, "router": {"kind": "top_p"}})
    model = gpt(config, gpt_decoder_block_spec(config, base, layer_overrides={2: other}))
    layers = [m for m in model.modules() if isinstance(m, MegatronMoELayer)]
    assert layers[0].cfg is base and layers[1].cfg is other
    assert type(layers[1].router).__name__ == "MegatronTopPRouter"
    mapped = gpt(config, decoder_block_spec(config, vp_stage=None))
    first, second = [m.cfg for m in mapped.modules() if isinstance(m, MegatronMoELayer)]
    assert first is second and first == base


def test_moe_layer_pattern():
    assert moe_layer_pattern(moe_config(num_layers=4, moe_layer_freq=2)) == [True, False, True, False]
    assert moe_layer_pattern(moe_config(num_layers=4, moe_layer_freq=1), first_k_dense=1) == \
        [False, True, True, True]
    assert moe_layer_pattern(moe_config()) == [False, True, True]


def test_spec_hook_objects(megatron):
    """`pretrain_gpt.py --spec megamoe.megatron.specs layer_spec|decoder_block_spec`."""
    config = moe_config(moe_layer_freq=1, num_layers=2)
    model = gpt(config, layer_spec)
    assert sum(isinstance(m, MegatronMoELayer) for m in model.modules()) == 2
    model = gpt(config, decoder_block_spec(config, vp_stage=None))
    assert sum(isinstance(m, MegatronMoELayer) for m in model.modules()) == 2
    tokens, labels = lm_batch(0)
    assert torch.isfinite(lm_loss(model, tokens, labels))


def test_megatron_finalize_model_grads_updates_megamoe_bias(megatron):
    """Megatron-LM's own bias update (finalize_model_grads with moe_router_enable_expert_bias)
    reads megamoe's counts and applies the same rule as step_balancing."""
    from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,
                                                                 reset_model_temporary_tensors)

    config = moe_config(moe_layer_freq=1, num_layers=2)
    model = gpt(config, decoder_block_spec(config))
    tokens, labels = lm_batch(3)
    lm_loss(model, tokens, labels).backward()
    routers = [m.router for m in model.modules() if isinstance(m, MegatronMoELayer)]
    expected = []
    for router in routers:
        counts = router.load.stats.selected_E.clone()
        rate = config.moe_router_bias_update_rate
        expected.append(router.expert_bias + rate * torch.sign(counts.mean() - counts))
    _update_router_expert_bias([model], config)
    reset_model_temporary_tensors(config, [model])
    for router, bias in zip(routers, expected):
        torch.testing.assert_close(router.expert_bias, bias)
        assert float(router.local_tokens_per_expert.sum()) == 0


def test_sequence_parallel_marks_replicated_weights(megatron):
    """With sequence parallelism, Megatron sums the router's and shared expert's gradients over
    tensor-parallel ranks only for parameters marked `sequence_parallel`; experts are not."""
    config = moe_config(moe_layer_freq=1, num_layers=1, sequence_parallel=True,
                        tensor_model_parallel_size=2,
                        moe_shared_expert_intermediate_size=16)
    layer = MegatronMoELayer(config)
    marked = {name for name, p in layer.named_parameters() if getattr(p, "sequence_parallel", False)}
    assert marked == {"router.weight", "shared_experts.linear_fc1.weight",
                      "shared_experts.linear_fc2.weight"}
