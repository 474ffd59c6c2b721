"""Multi-token prediction (DeepSeek-V3 tech report, arXiv 2412.19437, sec. 2.2) as megamoe builds
it (Megatron-Core's MTP block, megamoe layers inside): each depth's loss and the gradient of the
weighted sum against a naive implementation of the definition written here, on the same weights;
the MTP layers' global numbers; the settings' one-line refusals."""
import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from megatron.core.transformer.transformer_layer import TransformerLayer

from megamoe.balancing.owner import StepOwner
from megamoe.errors import CheckpointError, ConfigError
from megamoe.megatron.compat import reset_mtp_losses, take_mtp_losses, transformer_layer_number
from megamoe.megatron.cpu import cuda_as_cpu
from megamoe.megatron.fields import moe_config_from_transformer_config
from megamoe.megatron.masks import causal_attention_mask
from megamoe.megatron.moe_module import MegatronMoELayer
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.megatron.specs import gpt_decoder_block_spec, mtp_block_spec
from megamoe.train.config import config_from_dict
from tiny_models import build_gpt, tiny_transformer_config

VOCAB, SEQ, BATCH, DEPTHS, WEIGHT, EPS = 64, 12, 3, 2, 0.3, 1e-6


@pytest.fixture(scope="module")
def model():
    """A 2-layer GPT (layer 2 a megamoe layer) with 2 MTP depths, RoPE (so the embedding of a
    token is its row alone, as in the definition), random norm weights (so that swapping the two
    input norms, or their halves of the projection, shows)."""
    setup_megatron(seed=5)
    config = tiny_transformer_config(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1],
        normalization="RMSNorm", layernorm_epsilon=EPS, mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=WEIGHT)
    moe = moe_config_from_transformer_config(config, {"balancing": {"methods": "none"}})
    owner = StepOwner.STEP_BALANCING
    gpt = build_gpt(config, gpt_decoder_block_spec(config, moe, step_owner=owner), VOCAB, SEQ,
                    position_embedding_type="rope",
                    mtp_block_spec=mtp_block_spec(config, moe, step_owner=owner))
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    yield gpt
    teardown_megatron()


def rms_norm(x, weight):
    """RMSNorm (Zhang and Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def naive_mtp_losses(model, tokens):
    """The definition, depth by depth, on `model`'s weights: for k = 1..D and positions
    i < S - k, h'_i = M_k [RMSNorm(Emb(t_(i+k))); RMSNorm(h_i^(k-1))] (M_k's columns in the
    order of DeepSeek-V3's released `eh_proj`: the embedding's half first), h^k = TRM_k(h')
    (the depth's transformer layer, run as a black box on the truncated sequence), logits =
    OutHead(RMSNorm(h^k)) with the main model's output head, loss_k = mean cross-entropy of
    t_(i+k+1). h^0 is the main model's final (normalised) hidden state. Depth k + 1 reads h^k
    after the shared head's norm, as Megatron-Core chains depths (the paper chains h^k itself;
    the two agree for one depth, as every released model has)."""
    inputs, S = tokens[:, :SEQ], SEQ
    embed = model.embedding.word_embeddings.weight
    hidden = model.decoder(hidden_states=model.embedding(inputs, None),
                           attention_mask=causal_attention_mask(S),
                           rotary_pos_emb=model.rotary_pos_emb(S))  # [S, B, D]
    losses = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        n = S - k
        emb = embed[tokens[:, k:k + n]].transpose(0, 1)  # t_(i+k), [n, B, D]
        joined = torch.cat([rms_norm(emb, layer.enorm.weight),
                            rms_norm(hidden[:n], layer.hnorm.weight)], dim=-1)
        projected = joined @ layer.eh_proj.weight.T
        block = next(m for m in layer.children() if isinstance(m, TransformerLayer))
        out, _ = block(hidden_states=projected, attention_mask=causal_attention_mask(n),
                       rotary_pos_emb=model.rotary_pos_emb(n))
        hidden = rms_norm(out, layer.final_layernorm.weight)
        logits = hidden @ model.output_layer.weight.T  # [n, B, V]
        targets = tokens[:, k + 1:k + 1 + n].transpose(0, 1)  # t_(i+k+1)
        losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)))
    return losses


def test_mtp_losses_and_gradients_match_the_definition(model):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mtp_params = {n: p for n, p in model.named_parameters() if n.startswith("mtp.")}
    model.train()
    reset_mtp_losses()  # another test's model may have had another number of depths
    with cuda_as_cpu():
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        model.zero_grad()
        main = model(tokens[:, :SEQ], torch.arange(SEQ).expand(BATCH, -1),
                     causal_attention_mask(SEQ), labels=tokens[:, 1:]).mean()
        main.backward()  # the MTP losses ride on the main loss (MTPLossAutoScaler)
        got = take_mtp_losses()
    megatron_grads = {n: p.grad.clone() for n, p in mtp_params.items() if p.grad is not None}

    model.zero_grad()
    expected = naive_mtp_losses(model, tokens)
    (WEIGHT / DEPTHS * sum(expected)).backward()  # L_MTP = lambda / D * sum_k loss_k
    torch.testing.assert_close(got, torch.stack(expected).detach(), rtol=0, atol=1e-5)
    naive_grads = {n: p.grad for n, p in mtp_params.items() if p.grad is not None}
    assert naive_grads.keys() == megatron_grads.keys()
    assert any(n.endswith("eh_proj.weight") for n in naive_grads)
    for name, grad in naive_grads.items():
        torch.testing.assert_close(megatron_grads[name], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_mtp_layers_are_numbered_after_the_decoder(model):
    """Depth k's layer (and its megamoe layer) is global layer num_layers + k on either
    megatron-core version, so its metrics and random streams are its own."""
    layers = [m for m in model.mtp.modules() if isinstance(m, TransformerLayer)]
    assert [transformer_layer_number(layer) for layer in layers] == [3, 4]
    moe = [m for m in model.modules() if isinstance(m, MegatronMoELayer)]
    assert [layer.router.layer_number for layer in moe] == [2, 3, 4]


def test_megatron_lm_block_spec_gives_mtp_a_megamoe_layer(model):
    """Megatron-LM's way (`--spec megamoe.megatron.specs decoder_block_spec` and its own
    `get_gpt_mtp_block_spec`): the MTP depth is a megamoe layer of the last decoder layer's kind,
    numbered after the decoder's, and the model trains through it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from megamoe.megatron.specs import decoder_block_spec

    config = tiny_transformer_config(num_layers=2, num_moe_experts=4, moe_router_topk=2,
                                     moe_ffn_hidden_size=32, moe_layer_freq=[0, 1],
                                     mtp_num_layers=1)
    block = decoder_block_spec(config)
    gpt = build_gpt(config, block, VOCAB, SEQ, mtp_block_spec=get_gpt_mtp_block_spec(
        config, block, use_transformer_engine=False))
    moe = [m for m in gpt.modules() if isinstance(m, MegatronMoELayer)]
    assert [layer.router.layer_number for layer in moe] == [2, 3]
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with cuda_as_cpu():
        loss = gpt(tokens, torch.arange(SEQ).expand(BATCH, -1), causal_attention_mask(SEQ),
                   labels=tokens).mean()
        loss.backward()
    assert gpt.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    take_mtp_losses()


MOE = {"num_experts": 8, "ffn_hidden_size": 8}


@pytest.mark.parametrize("sections, message", [
    ({"model": {"mtp_layers": -1}}, "model.mtp_layers=-1 must be >= 0"),
    ({"model": {"mtp_loss_weight": -0.1}}, "model.mtp_loss_weight=-0.1 must be >= 0"),
    ({"model": {"mtp_loss_weight": float("nan")}}, "model.mtp_loss_weight=nan is not a finite"),
    ({"model": {"mtp_layers": 1, "first_k_dense": 4}, "finetune": {"method": "full"}},
     "model.mtp_layers=1 cannot be combined with finetune.method=full"),
    ({"model": {"mtp_layers": 1}, "parallel": {"pipeline": 2}},
     "model.mtp_layers=1 with model.position_embedding=learned_absolute at parallel.pipeline=2"),
])
def test_bad_mtp_settings_are_refused_in_one_line(sections, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"moe": MOE, **sections})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_mtp_with_rope_pipelines():
    config = config_from_dict({"moe": MOE, "parallel": {"pipeline": 2},
                               "model": {"mtp_layers": 2, "position_embedding": "rope"}})
    assert (config.model.mtp_layers, config.model.mtp_loss_weight) == (2, 0.1)


def test_init_from_may_drop_mtp_layers_but_not_add_them(tmp_path):
    """A checkpoint's MTP layers may be left unread (fewer in the run), but a run with more
    than it holds is refused in one line before Megatron is asked to load anything."""
    from megamoe.train.checkpoint_shapes import check_weights_fit

    def config(depths):
        return config_from_dict({"moe": MOE, "model": {"mtp_layers": depths,
                                                       "position_embedding": "rope"}})

    saved = {"megamoe_model": {"model": {"mtp_layers": 1, "position_embedding": "rope"},
                               "moe": MOE}, "iteration": 0}
    for depths in (0, 1):
        check_weights_fit(saved, config(depths), tmp_path)
    with pytest.raises(CheckpointError) as err:
        check_weights_fit(saved, config(2), tmp_path)
    assert "holds 1 multi-token-prediction layer(s) but this run's config says " \
        "model.mtp_layers=2" in str(err.value) and "\n" not in str(err.value)
