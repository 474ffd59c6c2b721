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
from megamoe.simoe.hard_concrete import clip_log_alpha, deterministic_gates, sample_gates
from megamoe.simoe.inference import inference_parameters, merged_dense_state_dict
from megamoe.simoe.interpolated import GatedColumns
from megamoe.simoe.model import SIMoEGPTModel, is_simoe_state
from megamoe.simoe.penalties import (SparsityLagrangian, expected_density, interpolated_modules,
                                     served_density, total_gated_parameters)

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


@pytest.mark.slow
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
        lagrangian.step(served_density([toy], total))
    final = served_density([toy], total)
    assert (final - 0.25).abs().max() < 0.02, final  # it starts at 1.0


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


def test_the_model_served_is_the_model_trained(megatron):
    """SMAT's nearly deterministic gate noise: with the same merging coefficients, training mode
    and inference mode compute the same function (the old U(0, 1) noise did not)."""
    _, model = dense_and_simoe(SIMoEConfig(num_experts=3))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("delta_weight", "mask_logits")):
                param.normal_(0.0, 0.3)
    coefficients = torch.softmax(torch.randn(BATCH, 3), dim=-1)
    tokens, _, _ = batch(2)
    outputs = {}
    for training in (True, False):
        model.train(training)
        with torch.no_grad():
            outputs[training] = logits(model, tokens, coefficients=coefficients)
    assert (outputs[True] - outputs[False]).abs().max() < 1e-4
    assert (outputs[True] - logits(dense_and_simoe(SIMoEConfig(num_experts=3))[0], tokens)
            ).abs().max() > 1e-2  # the deltas do change the model


def test_log_alpha_clip_is_a_wall_not_a_trap():
    bound = 4.6
    x = torch.tensor([-6.0, -6.0, 0.5, 6.0, 6.0], requires_grad=True)
    clipped = clip_log_alpha(x, bound)
    assert clipped.tolist() == pytest.approx([-4.6, -4.6, 0.5, 4.6, 4.6])
    upstream = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])
    clipped.backward(upstream)
    # Descent moves x by -grad: kept where that heads back inside (or x is inside).
    assert x.grad.tolist() == [0.0, -1.0, 1.0, 1.0, 0.0]


def test_straight_through_gates_keep_values_and_give_closed_gates_a_gradient():
    log_alpha = torch.tensor([-4.0, 0.0, 4.0], requires_grad=True)
    half = torch.full((3,), 0.5)
    hard = sample_gates(log_alpha, half)
    straight = sample_gates(log_alpha, half, straight_through=True)
    assert torch.allclose(hard, straight, atol=1e-7)
    assert hard.tolist() == [0.0, pytest.approx(0.5), 1.0]
    assert torch.equal(hard, deterministic_gates(log_alpha))  # served == trained at u = 1/2
    straight.sum().backward()
    s = torch.sigmoid(log_alpha.detach() / (2 / 3))
    assert torch.allclose(log_alpha.grad, 1.2 * s * (1 - s) / (2 / 3))  # d stretch / d log_alpha
    assert (log_alpha.grad > 0).all()


def test_router_reads_the_seeds_hidden_states_and_anneals(megatron):
    """a = s / sum(s), s_m = sigmoid(k_m . mean prompt hidden state / T), against the dense
    seed's own final hidden states; T falls linearly from 5 to 0.5."""
    simoe = SIMoEConfig(num_experts=4, router_anneal_steps=10)
    dense, model = dense_and_simoe(simoe)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("delta_weight", "mask_logits")):
                param.normal_(0.0, 0.3)  # the router must read the seed, not the experts
    tokens, _, prompt_mask = batch(4)
    hidden_SBH = seed_final_hidden(dense, tokens)
    keys = model.simoe_router.weight.detach() * simoe.router_lr_scale
    model.eval()
    for steps, temperature in ((0, 5.0), (4, 3.2), (10, 0.5), (30, 0.5)):
        model.simoe_router.updates.fill_(steps)
        with torch.no_grad():
            got = model.route(tokens, prompt_mask)
        for b in range(BATCH):
            pooled = hidden_SBH[prompt_mask[b], b].mean(dim=0)
            scores = torch.sigmoid(keys @ pooled / temperature)
            assert torch.allclose(got[b], scores / scores.sum(), atol=1e-5), (steps, b)
    assert (got.max(dim=-1).values - got.min(dim=-1).values).min() > 0.05  # prompts differ


def test_router_keeps_the_attention_mask_it_is_given(megatron):
    """Missing positions default to 0..S-1 without replacing a mask given beside them (here two
    packed documents, the second blind to the first): the seed pass sees the mask given."""
    _, model = dense_and_simoe(SIMoEConfig(num_experts=4))
    model.eval()
    tokens, _, prompt_mask = batch(5)
    two_documents = causal_attention_mask(SEQ).clone()
    two_documents[..., SEQ // 4:, :SEQ // 4] = True
    positions = torch.arange(SEQ).expand(BATCH, -1)
    with torch.no_grad():
        given = model.route(tokens, prompt_mask, attention_mask=two_documents)
        explicit = model.route(tokens, prompt_mask, positions, two_documents)
        causal = model.route(tokens, prompt_mask)
    assert torch.equal(given, explicit)
    assert (given - causal).abs().max() > 1e-4


def test_served_density_counts_the_columns_served():
    simoe = SIMoEConfig(num_experts=2, mask_lr_scale=1.0)
    toy = ToyGated(simoe, 10)
    with torch.no_grad():
        toy.mask_logits.copy_(torch.linspace(-3, 3, 20).reshape(2, 10))
    served = deterministic_gates(toy.mask_logits) > 0
    expected = served.float().mean(dim=1)
    assert torch.equal(served_density([toy], total_gated_parameters([toy])), expected)


def seed_final_hidden(dense, tokens):
    """The dense seed's final hidden states [S, B, H] for `tokens` (its decoder's output)."""
    hidden = []
    hook = dense.decoder.register_forward_hook(lambda _m, _i, out: hidden.append(out))
    with torch.no_grad():
        logits(dense.eval(), tokens)
    hook.remove()
    return hidden[0]


@pytest.fixture
def unit_aux_scale():
    """Megatron's aux-loss scale at 1 for the test, then unset again as in a fresh process
    (Megatron's schedules `copy_` their [1]-shaped scale into one that is set)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def test_router_logit_penalty_joins_the_loss_as_smat_writes_it(megatron, unit_aux_scale):
    """SMAT's 1e-4 x mean squared router logit: its value and its gradient on the router's keys,
    by hand from the dense seed's final hidden states (the masks' terms are 0 here: multipliers
    start at 0, no orthogonality weight)."""
    assert SIMoEConfig().router_logit_penalty == 1.0e-4
    coefficient = 0.05  # large enough that the gradient stands out of float32 noise
    simoe = SIMoEConfig(num_experts=3, router_logit_penalty=coefficient,
                        orthogonality_coefficient=0.0, router_lr_scale=1.0)
    dense, model = dense_and_simoe(simoe)
    tokens, _, prompt_mask = batch(7)
    hidden_SBH = seed_final_hidden(dense, tokens)
    keys = model.simoe_router.weight.detach().clone()
    pooled = torch.stack([hidden_SBH[prompt_mask[b], b].mean(dim=0) for b in range(BATCH)])
    router_logits = pooled @ keys.t()  # [B, M]
    by_hand = coefficient * sum(float(x) ** 2 for x in router_logits.flatten()) / (BATCH * 3)
    # d/dk_m of c/(B M) sum_b (k_m . f_b)^2 = 2c/(B M) sum_b (k_m . f_b) f_b
    grad_by_hand = 2 * coefficient / (BATCH * 3) * router_logits.t() @ pooled

    model.train()
    out = logits(model, tokens, prompt_mask=prompt_mask)
    assert abs(float(model.auxiliary_loss().detach()) - by_hand) < 1e-5 * max(1.0, by_hand)
    (out * 0.0).sum().backward()  # only the auxiliary loss sends a gradient
    assert torch.allclose(model.simoe_router.weight.grad, grad_by_hand, atol=1e-6, rtol=1e-4)

    off = SIMoEConfig(num_experts=3, router_logit_penalty=0.0, orthogonality_coefficient=0.0)
    _, model_off = dense_and_simoe(off)
    model_off.train()
    logits(model_off, tokens, prompt_mask=prompt_mask)
    assert float(model_off.auxiliary_loss().detach()) == 0.0


@pytest.mark.parametrize("weighted", [True, False])
def test_sparsity_lagrangian_is_weighted_by_the_detached_selection(megatron, weighted, unit_aux_scale):
    """SMAT: sum_m lambda_m s_m (E[density_m] - target), s_m the batch's mean coefficient of
    expert m, with no gradient to the router. Every gate of expert m at log-alpha v_m, so its
    expected density is P(z != 0) = sigmoid(v_m - beta log(-gamma / zeta)) by hand."""
    assert SIMoEConfig().selection_weighted_sparsity is True
    simoe = SIMoEConfig(num_experts=3, target_sparsity=0.75, mask_lr_scale=1.0,
                        orthogonality_coefficient=0.0, router_logit_penalty=0.0,
                        selection_weighted_sparsity=weighted)
    _, model = dense_and_simoe(simoe)
    values = [-1.0, 0.5, 2.0]
    with torch.no_grad():
        for module in interpolated_modules(model):
            for m, v in enumerate(values):
                module.mask_logits[m].fill_(v)
        model.simoe_regularizer.lagrangian.multipliers.copy_(torch.tensor([0.3, 0.7, 1.1]))
    import math
    shift = (2.0 / 3.0) * math.log(0.1 / 1.1)
    density = [1.0 / (1.0 + math.exp(-(v - shift))) for v in values]
    coefficients = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0],
                                 [0.2, 0.3, 0.5]], requires_grad=True)
    selection = [sum(float(coefficients[b, m]) for b in range(BATCH)) / BATCH for m in range(3)]
    weights = selection if weighted else [1.0, 1.0, 1.0]
    multipliers = [0.3, 0.7, 1.1]
    by_hand = sum(multipliers[m] * weights[m] * (density[m] - 0.25) for m in range(3))

    model.train()
    tokens, _, _ = batch(8)
    out = logits(model, tokens, coefficients=coefficients)
    assert abs(float(model.auxiliary_loss().detach()) - by_hand) < 1e-5
    (out * 0.0).sum().backward()
    assert torch.count_nonzero(coefficients.grad) == 0  # the selection is detached
    # d/dv of one gate: lambda_m w_m p_m (1 - p_m) x (parameters it covers / all gated ones)
    modules = interpolated_modules(model)
    total = sum(mod.gated.covered_parameters for mod in modules)
    module = modules[0]
    for m in range(3):
        expected = multipliers[m] * weights[m] * density[m] * (1 - density[m]) \
            * module.gated.rows / total
        assert torch.allclose(module.mask_logits.grad[m],
                              torch.full_like(module.mask_logits.grad[m], expected),
                              rtol=1e-4, atol=1e-9), m
