"""SIMoE (arXiv 2506.12597) against independent references: the dense model it starts from, a
plain delta fine-tune of the dense model, and the target sparsity on a toy problem."""
import pytest
import torch

from tiny_models import build_gpt, tiny_transformer_config
from megamoe.instruct.lora import lora_gpt, rank_matching
from megamoe.megatron.masks import causal_attention_mask
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.megatron.specs import get_gpt_layer_local_spec
from megamoe.simoe.config import SIMoEConfig
from megamoe.simoe.inference import inference_parameters, merged_dense_state_dict
from megamoe.simoe.interpolated import GatedColumns
from megamoe.simoe.model import SIMoEGPTModel, is_simoe_state
from megamoe.simoe.penalties import (SparsityLagrangian, expected_density, interpolated_modules,
                                     total_gated_parameters)

VOCAB, SEQ, BATCH = 64, 12, 4


@pytest.fixture(scope="module")
def megatron():
    setup_megatron(seed=3)
    yield
    teardown_megatron()


def config(**changes):
    return tiny_transformer_config(**{"normalization": "RMSNorm", "gated_linear_unit": True,
                                      **changes})


def dense_and_simoe(simoe: SIMoEConfig, cfg=None):
    cfg = cfg or config()
    dense = build_gpt(cfg, get_gpt_layer_local_spec(normalization=cfg.normalization),
                      vocab_size=VOCAB, seq_len=SEQ)
    model = SIMoEGPTModel(cfg, simoe, vocab_size=VOCAB, max_sequence_length=SEQ,
                          share_embeddings_and_output_weights=False)
    missing, unexpected = model.load_state_dict(dense.state_dict(), strict=False)
    assert unexpected == []
    assert missing and all(is_simoe_state(k) for k in missing), missing
    return dense, model


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    prompt_mask = torch.arange(SEQ).expand(BATCH, -1) < SEQ // 2
    return tokens[:, :-1], tokens[:, 1:], prompt_mask


def logits(model, tokens, **kwargs):
    positions = torch.arange(SEQ).expand(tokens.shape[0], -1)
    return model(tokens, positions, causal_attention_mask(SEQ), **kwargs)


@pytest.mark.parametrize("training", [True, False])
def test_initial_simoe_model_is_the_dense_model(megatron, training):
    dense, model = dense_and_simoe(SIMoEConfig())
    dense.train(training)
    model.train(training)
    tokens, _, prompt_mask = batch(0)
    with torch.no_grad():
        expected = logits(dense, tokens)
        got = logits(model, tokens, prompt_mask=prompt_mask)
    assert (got - expected).abs().max() < 1e-5
    assert sorted({n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}) \
        == ["delta_weight", "mask_logits", "weight"]  # the last: the router's only


def test_dense_masks_and_one_hot_router_are_a_plain_delta_fine_tune(megatron):
    """Gates fixed at 1 (sparsity 0) and all weight on one expert: W0 + Delta trains exactly as
    the dense model's own linear and norm weights do, step for step."""
    dense, model = dense_and_simoe(SIMoEConfig(num_experts=3))
    for module in interpolated_modules(model):
        module.mask_logits.data.fill_(30.0)  # z == 1 for any noise: every column kept
    dense_trained = [p for n, p in dense.named_parameters()
                     if "decoder" in n and not n.endswith("bias")]
    for n, p in dense.named_parameters():
        p.requires_grad_(p in set(dense_trained) or False)
    deltas = [p for n, p in model.named_parameters() if n.endswith("delta_weight")]
    assert len(deltas) == len(dense_trained)
    opt_dense = torch.optim.Adam(dense_trained, lr=1e-2)
    opt_simoe = torch.optim.Adam(deltas, lr=1e-2)
    one_hot = torch.nn.functional.one_hot(torch.full((BATCH,), 1), 3).float()
    for step in range(4):
        tokens, labels, _ = batch(step)
        for model_, opt, kwargs in ((dense, opt_dense, {}),
                                    (model, opt_simoe, {"coefficients": one_hot})):
            opt.zero_grad()
            logits(model_, tokens, labels=labels, **kwargs).mean().backward()
            opt.step()
    tokens, _, _ = batch(99)
    with torch.no_grad():
        gap = (logits(model, tokens, coefficients=one_hot) - logits(dense, tokens)).abs().max()
    assert gap < 1e-4
    assert max(d.abs().max() for d in deltas) > 1e-3  # the deltas did move


class ToyGated(torch.nn.Module):
    """y = x (w0 + sum_m a_m z_m * delta): a regression that wants every column kept."""

    def __init__(self, simoe, columns):
        super().__init__()
        self.delta = torch.nn.Parameter(torch.zeros(columns))
        self.gated = GatedColumns(self, simoe, columns, slice(None), 1, self.delta)
        self.splits_gates = False


def test_lagrangian_drives_expected_sparsity_to_the_target():
    torch.manual_seed(0)
    simoe = SIMoEConfig(num_experts=2, target_sparsity=0.75, lagrangian_lr=0.5, mask_lr_scale=1.0)
    columns = 200
    toy = ToyGated(simoe, columns)
    target_w = torch.randn(columns)
    lagrangian = SparsityLagrangian(simoe)
    optimizer = torch.optim.Adam(toy.parameters(), lr=0.05)
    total = total_gated_parameters([toy])
    for _ in range(1500):
        x = torch.randn(64, columns)
        gates_MI = toy.gated.gates(toy.mask_logits, training=True)
        prediction = x @ (gates_MI.mean(0) * toy.delta)
        density_M = expected_density([toy], total)
        fit = ((prediction - x @ target_w) ** 2).mean() / columns  # about 1 at the start
        loss = fit + lagrangian.penalty(density_M)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        lagrangian.step(expected_density([toy], total))
    final = expected_density([toy], total).detach()
    assert (final - 0.25).abs().max() < 0.02, final  # it starts at 0.82


def test_merged_dense_model_serves_each_sequence_as_simoe_does(megatron):
    dense, model = dense_and_simoe(SIMoEConfig(num_experts=4))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("delta_weight", "mask_logits")) or "router" in name:
                param.normal_(0.0, 0.3)
    model.eval()
    dense.eval()
    tokens, _, prompt_mask = batch(5)
    with torch.no_grad():
        coefficients = model.route(tokens, prompt_mask)
        expected = logits(model, tokens, coefficients=coefficients)
        for b in range(BATCH):
            dense.load_state_dict(merged_dense_state_dict(model, coefficients[b]))
            got = logits(dense, tokens[b:b + 1])
            assert (got - expected[b:b + 1]).abs().max() < 1e-5
    counts = inference_parameters(model)
    assert counts["active"] == sum(p.numel() for p in dense.parameters())
    assert counts["stored"] > counts["active"]


def test_lora_is_the_dense_model_plus_its_low_rank_update(megatron):
    cfg = config()
    dense = build_gpt(cfg, get_gpt_layer_local_spec(normalization=cfg.normalization),
                      vocab_size=VOCAB, seq_len=SEQ)
    lora = lora_gpt(cfg, rank=3, alpha=6.0, vocab_size=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=False)
    missing, unexpected = lora.load_state_dict(dense.state_dict(), strict=False)
    assert unexpected == [] and all(k.endswith(("lora_a", "lora_b")) for k in missing)
    tokens, _, _ = batch(1)
    with torch.no_grad():
        assert (logits(lora, tokens) - logits(dense, tokens)).abs().max() < 1e-5
        for name, param in lora.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0.0, 0.1)
        merged = dense.state_dict()
        for name, module in lora.named_modules():
            if hasattr(module, "lora_a"):
                merged[f"{name}.weight"] = module.weight + 2.0 * module.lora_b @ module.lora_a
        dense.load_state_dict(merged)
        assert (logits(lora, tokens) - logits(dense, tokens)).abs().max() < 1e-5
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert trainable == 3 * sum(sum(m.lora_a.shape[1:]) + m.lora_b.shape[0]
                                for m in lora.modules() if hasattr(m, "lora_a"))
    assert rank_matching(dense, trainable) == 3
