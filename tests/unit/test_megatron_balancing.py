"""megamoe's balancing against Megatron-Core's own: its TopKRouter on identical weights and
inputs (routing map, gates, loss values, gradients), and its `finalize_model_grads` driving
megamoe's expert biases over several steps, with Megatron's MoE logging tracker."""
import warnings

import pytest
import torch
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler, clear_aux_losses_tracker,
                                                     get_moe_layer_wise_logging_tracker,
                                                     track_moe_metrics)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from megamoe import ConfigError, MoEConfig
from megamoe.balancing import maxvio, step_balancing
from megamoe.balancing.owner import StepOwner
from megamoe.layer import MoELayer
from megamoe.megatron.compat import reset_moe_tracker
from megamoe.megatron.fields import moe_config_from_transformer_config
from megamoe.megatron.masks import causal_attention_mask
from tiny_models import tiny_transformer_config
from megamoe.megatron.moe_module import MegatronMoELayer
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.megatron.specs import gpt_decoder_block_spec
from megatron_chunk import MegatronChunk

S, B, H, E = 8, 3, 16, 8
MEGATRON_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                       "global_aux_loss": "global_load_balancing_loss", "z_loss": "z_loss"}


@pytest.fixture(scope="module")
def megatron():
    setup_megatron(seed=5)
    yield
    teardown_megatron()


@pytest.fixture(autouse=True)
def fresh_tracker():
    reset_moe_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield
    reset_moe_tracker()


COMBINATIONS = {
    # DeepSeek-V3's recipe: sigmoid scores, bias, sequence-wise aux loss 1e-4, gates x 2.5.
    "bias_seq_aux": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
                         moe_router_topk_scaling_factor=2.5, moe_z_loss_coeff=1e-3),
    "bias_aux": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
    "bias_global_aux": dict(moe_router_score_function="sigmoid",
                            moe_router_enable_expert_bias=True,
                            moe_router_load_balancing_type="global_aux_loss",
                            moe_aux_loss_coeff=1e-2),
    "aux_and_seq_aux_lists": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                                  moe_aux_loss_coeff=[1e-2, 1e-3], moe_z_loss_coeff=1e-3),
    "softmax_pre_z": dict(moe_router_pre_softmax=True, moe_router_load_balancing_type="aux_loss",
                          moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-2),
    # DeepSeek-V4's scores, sqrt(softplus(logit)), with the bias and without (megatron-core 0.19).
    "sqrtsoftplus_bias_seq_aux": dict(moe_router_score_function="sqrtsoftplus",
                                      moe_router_enable_expert_bias=True,
                                      moe_router_load_balancing_type="seq_aux_loss",
                                      moe_aux_loss_coeff=1e-4, moe_router_topk_scaling_factor=2.5),
    "sqrtsoftplus_aux": dict(moe_router_score_function="sqrtsoftplus",
                             moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
}
# Score functions this megatron-core's TransformerConfig offers (0.16.1: softmax and sigmoid).
MEGATRON_SCORE_FUNCTIONS = str(
    TransformerConfig.__dataclass_fields__["moe_router_score_function"].type)


def _case(name: str):
    """`name` as a parameter, skipped where Megatron-Core lacks its score function."""
    function = COMBINATIONS[name].get("moe_router_score_function", "softmax")
    return pytest.param(name, marks=pytest.mark.skipif(
        function not in MEGATRON_SCORE_FUNCTIONS,
        reason=f"this megatron-core has no {function} scores"))


def router_pair(settings, bias=None):
    tc = tiny_transformer_config(num_layers=1, hidden_size=H, num_attention_heads=2,
                                 num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=8,
                                 **settings)
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    theirs = TopKRouter(tc, pg_collection=get_default_pg_collection())
    theirs.set_layer_number(1)
    ours = MoELayer(moe_config_from_transformer_config(tc))
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(1)) * 0.5)
        ours.router.weight.copy_(theirs.weight)
        if bias is not None:
            theirs.expert_bias.copy_(bias)
            ours.router.expert_bias.copy_(bias)
    return tc, theirs, ours


@pytest.mark.parametrize("case", [_case(name) for name in sorted(COMBINATIONS)])
def test_balancing_matches_megatron_topk_router(megatron, case):
    tc, theirs, ours = router_pair(COMBINATIONS[case])
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    weights_TE = torch.randn(S * B, E, generator=torch.Generator().manual_seed(3))

    probs, routing_map = theirs(x)
    (probs * weights_TE).sum().backward()

    routing = ours.router(x.reshape(S * B, H))
    losses = ours.balance_losses(routing, S, B)
    total = (routing.gates_TE * weights_TE).sum() + sum(ours._weighted(losses).values())
    total.backward()

    assert torch.equal(routing.selected_TE, routing_map)
    torch.testing.assert_close(routing.gates_TE, probs, rtol=1e-6, atol=1e-7)
    tracker = get_moe_layer_wise_logging_tracker()
    expected_names = {MEGATRON_LOSS_NAMES[n] for n in losses}
    assert expected_names == set(tracker)
    for name, value in losses.items():
        torch.testing.assert_close(value.detach(), tracker[MEGATRON_LOSS_NAMES[name]]["values"][0],
                                   rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(ours.router.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-8)


MEGATRON_HAS_QB = "moe_router_quantile_balancing_ema" in TransformerConfig.__dataclass_fields__


@pytest.mark.skipif(not MEGATRON_HAS_QB, reason="this megatron-core has no quantile balancing")
@pytest.mark.parametrize("score", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_quantile_balancing_matches_megatron_over_five_global_batches(megatron, score):
    """Megatron-Core's TopKRouter with quantile_balancing, its finalize_model_grads ending each
    global batch of 2 micro-batches, against megamoe's layer built from the same
    TransformerConfig twice: as Megatron-LM's --spec builds it (finalize_model_grads updates
    the bias) and under megamoe's own loop (`step_balancing`). Routing map, probabilities and
    the bias after each of 5 updates."""
    settings = dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0,
                    moe_router_quantile_balancing_ema=0.5, moe_router_score_function=score,
                    moe_router_topk_scaling_factor=2.5 if score != "softmax" else None)
    tc, theirs, own_loop = router_pair(settings)
    megatron_lm = MegatronMoELayer(tc)
    assert megatron_lm.router.step_owner is StepOwner.FINALIZE_MODEL_GRADS
    megatron_lm.load_state_dict(own_loop.state_dict())
    for step in range(5):
        for micro in range(2):
            x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(10 * step + micro))
            probs, routing_map = theirs(x)
            for layer in (own_loop, megatron_lm):
                routing = layer.router(x.reshape(S * B, H))
                assert torch.equal(routing.selected_TE, routing_map)
                torch.testing.assert_close(routing.gates_TE, probs.detach(), rtol=1e-6,
                                           atol=1e-7)
        finalize_model_grads([MegatronChunk(theirs)])
        finalize_model_grads([MegatronChunk(megatron_lm)])
        step_balancing(own_loop)
        assert float(theirs.qb_beta.abs().max()) > 1e-3
        for layer in (own_loop, megatron_lm):
            torch.testing.assert_close(layer.router.qb_beta, theirs.qb_beta, rtol=0, atol=1e-6)
    clear_aux_losses_tracker()


@pytest.mark.skipif(not MEGATRON_HAS_QB, reason="this megatron-core has no quantile balancing")
def test_quantile_balancing_state_dict_is_megatrons(megatron):
    _, theirs, ours = router_pair(dict(moe_router_load_balancing_type="quantile_balancing",
                                       moe_aux_loss_coeff=0.0))
    assert set(theirs.state_dict()) == set(ours.router.state_dict())


@pytest.mark.parametrize("case", [_case("bias_seq_aux"), _case("sqrtsoftplus_bias_seq_aux")])
def test_group_limited_bias_routing_matches_megatron(megatron, case):
    """DeepSeek-V3 routing (4 of 8 groups... here 2 of 4, bias, scaling 2.5), with its sigmoid
    scores and with sqrtsoftplus: the same experts and gates as Megatron's router for a non-zero
    bias."""
    settings = dict(COMBINATIONS[case], moe_router_num_groups=4, moe_router_group_topk=2)
    bias = torch.linspace(-0.2, 0.3, E)
    _, theirs, ours = router_pair(settings, bias)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
    probs, routing_map = theirs(x)
    routing = ours.router(x.reshape(S * B, H))
    assert torch.equal(routing.selected_TE, routing_map)
    torch.testing.assert_close(routing.gates_TE, probs.detach(), rtol=1e-6, atol=1e-7)


# Megatron's "position" policy is torch.topk over the 0/1 routing map (ties broken as the kernel
# happens to), not "earliest first" as megamoe's; only "probs" has a defined common meaning.
@pytest.mark.parametrize("policy", ["probs"])
def test_capacity_drops_match_megatron(megatron, policy):
    settings = dict(moe_router_load_balancing_type="none", moe_expert_capacity_factor=0.75,
                    moe_token_drop_policy=policy)
    _, theirs, ours = router_pair(settings)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(6))
    probs, routing_map = theirs(x)
    from megamoe.routing import apply_capacity

    routing = apply_capacity(ours.router(x.reshape(S * B, H)), 0.75, policy)
    assert int(routing.routing_map_TE.sum()) < int(routing.selected_TE.sum())  # tokens dropped
    assert torch.equal(routing.routing_map_TE, routing_map)
    torch.testing.assert_close(routing.gates_TE, probs.detach(), rtol=1e-6, atol=1e-7)


def test_per_token_loss_scaling_matches_megatron(megatron):
    """--calculate-per-token-loss: the balance losses' gradient is scaled by the local tokens.
    (Megatron scales its sequence-aux loss by the sequence length only, S instead of S * B
    tokens; megamoe scales every loss by its tokens, so that case is not compared.)"""
    settings = dict(COMBINATIONS["bias_aux"], moe_z_loss_coeff=1e-2, calculate_per_token_loss=True)
    tc, theirs, _ = router_pair(settings)
    ours = MegatronMoELayer(tc)
    with torch.no_grad():
        ours.router.weight.copy_(theirs.weight)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))
    probs, _ = theirs(x)
    (probs * 0).sum().backward()
    out, _ = ours(x)
    (out * 0).sum().backward()
    torch.testing.assert_close(ours.router.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-8)


def test_softmax_scores_with_bias_stay_available_in_megamoe_config():
    cfg = MoEConfig.from_dict({"hidden_size": H, "num_experts": E, "ffn_hidden_size": 8,
                               "router": {"score_function": "softmax"},
                               "balancing": {"methods": ["bias", "seq_aux_loss", "aux_loss"],
                                             "aux_loss_coeff": [1e-4, 1e-3]}})
    assert cfg.balancing.uses_expert_bias and cfg.balancing.loss_coeffs == {
        "seq_aux_loss": 1e-4, "aux_loss": 1e-3}
    layer = MoELayer(cfg)
    layer.router.expert_bias.copy_(torch.linspace(-1, 1, E))
    routing = layer.router(torch.randn(10, H))
    assert set(layer.balance_losses(routing, 10, 1)) == {"seq_aux_loss", "aux_loss"}


# ---------------------------------------------------------------------------------------------
# Megatron's finalize_model_grads as the training loop's bias update



def heterogeneous_gpt():
    """4 layers: dense, MoE 4 experts with bias, MoE 8 experts with bias, MoE 4 experts
    without bias (aux loss only), all in one bias run."""
    from megatron.core.models.gpt import GPTModel

    tc = tiny_transformer_config(num_layers=4, num_moe_experts=4, moe_router_topk=2,
                                 moe_ffn_hidden_size=16, moe_layer_freq=[0, 1, 1, 1],
                                 moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True,
                                 moe_router_bias_update_rate=1e-2,
                                 moe_router_load_balancing_type="seq_aux_loss",
                                 moe_aux_loss_coeff=1e-4, moe_z_loss_coeff=1e-3)
    spec = gpt_decoder_block_spec(tc, layer_overrides={2: {"num_experts": 8, "topk": 3},
                                                       3: {"balancing": {"methods": "aux_loss",
                                                                         "aux_loss_coeff": 1e-2}}})
    model = GPTModel(tc, spec, vocab_size=64, max_sequence_length=16,
                     share_embeddings_and_output_weights=False)
    return tc, model


def test_megatron_finalize_model_grads_drives_heterogeneous_layers(megatron):
    tc, model = heterogeneous_gpt()
    layers = [m for m in model.modules() if isinstance(m, MegatronMoELayer)]
    assert [(l.cfg.num_experts, l.cfg.balancing.uses_expert_bias) for l in layers] == \
        [(4, True), (8, True), (4, False)]
    assert not hasattr(layers[2].router, "expert_bias")
    captured = {id(l.router): [] for l in layers}
    for layer in layers:
        layer.router.register_forward_hook(
            lambda mod, args, out: captured[id(mod)].append(out) if mod.training else None)
    chunk = MegatronChunk(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected_bias = {id(l.router): torch.zeros(l.cfg.num_experts) for l in layers[:2]}
    for step in range(4):
        for values in captured.values():
            values.clear()
        optimizer.zero_grad()
        for micro in range(2):
            tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + micro))
            positions = torch.arange(16).expand(2, -1)
            model(tokens, positions, causal_attention_mask(16), labels=tokens).mean().backward()
        # Megatron's own step: finalize_model_grads (bias update and reset), optimizer, logging.
        finalize_model_grads([chunk])
        optimizer.step()
        for layer in layers[:2]:
            counts = sum(r.selected_TE.sum(0).float() for r in captured[id(layer.router)])
            expected_bias[id(layer.router)] += 1e-2 * torch.sign(counts.mean() - counts)
            torch.testing.assert_close(layer.router.bias_E, expected_bias[id(layer.router)])
            assert float(layer.router.local_tokens_per_expert.abs().sum()) == 0
        tracker = get_moe_layer_wise_logging_tracker()
        # The tracker holds this step's two micro-batches per layer (Megatron sums them).
        for layer in layers:
            index = layer.router.layer_number - 1
            mb_maxvio = sum(float(maxvio(r.selected_TE.sum(0).float()))
                            for r in captured[id(layer.router)])
            assert float(tracker["moe_maxvio_batch"]["values"][index]) == pytest.approx(mb_maxvio, rel=1e-5)
        assert float(tracker["seq_load_balancing_loss"]["values"][1]) > 0
        assert float(tracker["load_balancing_loss"]["values"][3]) > 0
        assert float(tracker["load_balancing_loss"]["values"][1]) == 0
        totals = {}
        track_moe_metrics(loss_scale=0.5, iteration=step, total_loss_dict=totals,
                          num_layers=4, moe_layer_freq=[0, 1, 1, 1],
                          track_names=["seq_load_balancing_loss", "load_balancing_loss", "z_loss"])
        assert totals["z_loss"] > 0
    # Each step's tracker held that step only: micro-batch counts did not grow.
    for layer in layers:
        assert float(layer.router.load.stats.microbatches) == 2
    biases = [layer.router.bias_E.clone() for layer in layers[:2]]
    metrics = step_balancing(model)  # safe after Megatron's update: metrics, no second update
    assert all(torch.equal(b, l.router.bias_E) for b, l in zip(biases, layers[:2]))
    assert metrics["moe/layer3/experts_per_token"] == pytest.approx(3.0)


def test_step_balancing_after_finalize_with_no_tokens_is_safe(megatron):
    tc, model = heterogeneous_gpt()
    finalize_model_grads([MegatronChunk(model)])
    assert step_balancing(model) == {}
    clear_aux_losses_tracker()


def test_padded_bias_survives_state_dict_round_trip(megatron):
    _, model = heterogeneous_gpt()
    router = [m for m in model.modules() if isinstance(m, MegatronMoELayer)][0].router
    assert router.expert_bias.numel() == 8 and router.cfg.num_experts == 4
    router.bias_E.copy_(torch.tensor([0.1, -0.2, 0.3, -0.4]))
    state = model.state_dict()
    key = [k for k in state if k.endswith("router.expert_bias")][0]
    assert state[key].shape == (4,)
    _, fresh = heterogeneous_gpt()
    fresh.load_state_dict(state)
    fresh_router = [m for m in fresh.modules() if isinstance(m, MegatronMoELayer)][0].router
    assert torch.equal(fresh_router.bias_E, router.bias_E)
    assert float(fresh_router.expert_bias[4:].abs().sum()) == 0


def test_moe_layer_recompute_recomputes_the_layer_and_counts_it_once(megatron):
    """Megatron-LM's --moe-layer-recompute: Megatron-Core turns it into selective recompute of
    'moe'. The layer's forward then runs again in the backward pass, with the same gradients as
    without recomputation and the router's counts taken from the kept forward only."""
    settings = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                    moe_router_topk=2, moe_ffn_hidden_size=8, **COMBINATIONS["bias_aux"])
    recomputed = tiny_transformer_config(moe_layer_recompute=True, **settings)
    assert recomputed.recompute_granularity == "selective" and "moe" in recomputed.recompute_modules
    layers = {"plain": MegatronMoELayer(tiny_transformer_config(**settings)),
              "recomputed": MegatronMoELayer(recomputed)}
    layers["recomputed"].load_state_dict(layers["plain"].state_dict())
    results = {}
    for name, layer in layers.items():
        calls = []
        layer.router.register_forward_hook(lambda *_: calls.append(1))
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
        out, _ = layer(x)
        (out ** 2).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        results[name] = (len(calls), x.grad, grads, layer.router.load.stats.selected_E.clone())
    (plain_calls, plain_dx, plain_grads, plain_counts), (calls, dx, grads, counts) = \
        results["plain"], results["recomputed"]
    assert (plain_calls, calls) == (1, 2)
    torch.testing.assert_close(dx, plain_dx, rtol=1e-5, atol=1e-7)
    for n, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[n], rtol=1e-5, atol=1e-7)
    assert torch.equal(counts, plain_counts) and counts.sum() == S * B * 2


STEP_STATE = {
    "threshold": {"router": {"kind": "threshold", "warmup_steps": 1, "ema_decay": 0.5},
                  "topk": 1, "balancing": {"methods": "none"}},
    "adaptive_aux": {"balancing": {"methods": "adaptive_aux_loss", "aux_loss_coeff": 1e-2},
                     "dispatcher": {"capacity_factor": 1.0}},
    "bias_without_megatron_flag": {"balancing": {"methods": "bias", "bias_update_rate": 0.05},
                                   "router": {"score_function": "sigmoid"}},
    "quantile": {"balancing": {"methods": "quantile", "quantile_ema": 0.5}},
}


def _step_state(router) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in router.named_buffers()
            if n in ("threshold_ema", "threshold_updates", "adaptive_aux_coeff", "expert_bias",
                     "qb_beta")}


@pytest.mark.parametrize("case", sorted(STEP_STATE))
def test_megatron_lm_loop_applies_what_only_step_balancing_applied(megatron, case):
    """Megatron-LM's loop never calls step_balancing; its logging zeroes the MoE tracker once
    per iteration. Driven that way, a layer whose balancing has per-step state routes every
    micro-batch as under megamoe's own loop and reaches the same state."""
    tc = tiny_transformer_config(num_layers=1, hidden_size=H, num_attention_heads=2,
                                 num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=8)
    cfg = moe_config_from_transformer_config(tc, STEP_STATE[case])
    reference = MegatronMoELayer(tc, moe=cfg, step_owner=StepOwner.STEP_BALANCING)
    megatron_lm = MegatronMoELayer(tc, moe=cfg)  # Megatron-LM's loop: no owner in the spec
    assert megatron_lm.router.step_owner is StepOwner.NEXT_FORWARD
    megatron_lm.load_state_dict(reference.state_dict())
    initial = _step_state(reference.router)

    def run(layer, end_of_step):
        layer.set_layer_number(1)
        outputs, states = [], []
        for step in range(4):
            states.append(_step_state(layer.router))
            for micro in range(2):
                x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(10 * step + micro))
                outputs.append(layer(x)[0].detach())
            end_of_step(layer, step)
        return outputs, states

    ours, our_states = run(reference, lambda layer, step: step_balancing(layer))
    clear_aux_losses_tracker()
    theirs, their_states = run(megatron_lm, lambda layer, step: track_moe_metrics(
        loss_scale=0.5, iteration=step, total_loss_dict={}, num_layers=1, moe_layer_freq=1))
    assert not any(torch.equal(initial[n], our_states[-1][n]) for n in initial)
    for theirs_out, our_out in zip(theirs, ours):
        torch.testing.assert_close(theirs_out, our_out)
    # Under Megatron-LM's loop a step's update lands in the next step's first forward: after
    # step 3's forwards the layer holds the updates of steps 0..2, as megamoe's did before step 3.
    for n, value in _step_state(megatron_lm.router).items():
        torch.testing.assert_close(value, our_states[3][n])
    assert their_states[0].keys() == initial.keys()


# ---------------------------------------------------------------------------------------------
# Who ends a step, decided when the model is built

def test_the_step_owner_is_named_when_the_layer_is_built(megatron):
    settings = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                    moe_router_topk=2, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid")
    flagged = tiny_transformer_config(moe_router_enable_expert_bias=True, **settings)
    plain = tiny_transformer_config(**settings)
    bias = moe_config_from_transformer_config(plain, {"balancing": {"methods": "bias"}})
    owners = {"megatron_lm_with_flag": MegatronMoELayer(flagged),
              "megatron_lm_without_flag": MegatronMoELayer(plain, moe=bias),
              "megamoe_trainer": MegatronMoELayer(plain, moe=bias,
                                                  step_owner=StepOwner.STEP_BALANCING)}
    assert {name: layer.router.step_owner for name, layer in owners.items()} == {
        "megatron_lm_with_flag": StepOwner.FINALIZE_MODEL_GRADS,
        "megatron_lm_without_flag": StepOwner.NEXT_FORWARD,
        "megamoe_trainer": StepOwner.STEP_BALANCING}
    # Megatron's finalize_model_grads finds the counts only where it owns the bias.
    assert [hasattr(layer.router, "local_tokens_per_expert") for layer in owners.values()] == \
        [True, False, False]


def test_a_bias_has_one_owner(megatron):
    """finalize_model_grads updates every bias at moe_router_bias_update_rate when the flag is
    on: a layer whose bias something else updates, or that needs a schedule, is refused."""
    tc = tiny_transformer_config(num_layers=1, hidden_size=H, num_attention_heads=2,
                                 num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=8,
                                 moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True)
    cfg = moe_config_from_transformer_config(tc)
    with pytest.raises(ConfigError, match="updated by step_balancing; turn the flag on exactly"):
        MegatronMoELayer(tc, moe=cfg, step_owner=StepOwner.STEP_BALANCING)
    scheduled = cfg.merged({"balancing": {"bias_update_schedule": [[100, 0.0]]}})
    with pytest.raises(ConfigError) as err:
        MegatronMoELayer(tc, moe=scheduled)
    assert "balancing.bias_update_schedule=[[100, 0.0]]" in str(err.value)
    assert "\n" not in str(err.value)


def test_step_balancing_moves_a_bias_that_finalize_model_grads_never_took(megatron):
    """A loop of one's own over layers built with moe_router_enable_expert_bias (step owner:
    Megatron's finalize_model_grads), which never calls finalize_model_grads but calls
    step_balancing: each step the bias moves by u * sign(mean(c) - c) of that step's counts,
    with one warning naming the step owner; once finalize_model_grads takes the counts,
    step_balancing leaves the bias alone."""
    tc = tiny_transformer_config(num_layers=1, hidden_size=H, num_attention_heads=2,
                                 num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=8,
                                 moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True)
    layer = MegatronMoELayer(tc)
    router = layer.router
    assert router.step_owner is StepOwner.FINALIZE_MODEL_GRADS
    rate = router.cfg.balancing.bias_update_rate
    expected = torch.zeros(E)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        layer(torch.randn(S, B, H, generator=generator))
        counts = router.load.stats.selected_E.clone()
        expected += rate * torch.sign(counts.mean() - counts)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step_balancing(layer)
        notes = [w for w in caught if "finalize_model_grads" in str(w.message)]
        assert len(notes) == (1 if step == 0 else 0)
        assert "step_owner=StepOwner.STEP_BALANCING" in str(notes[0].message) if notes else True
        torch.testing.assert_close(router.bias_E, expected, rtol=0, atol=1e-7)
        assert float(router.local_tokens_per_expert.sum()) == 0
    assert float(expected.abs().sum()) > 0
    layer(torch.randn(S, B, H, generator=generator))
    router.local_tokens_per_expert.zero_()  # what finalize_model_grads does after its update
    step_balancing(layer)
    torch.testing.assert_close(router.bias_E, expected, rtol=0, atol=0)


def test_a_step_that_never_ends_is_reported_once(megatron, monkeypatch):
    """Layers whose steps end at Megatron's MoE logging, in a loop with neither that logging nor
    step_balancing: after MAX_FORWARDS_PER_STEP counted forwards one warning says so."""
    import megamoe.megatron.moe_module as moe_module

    monkeypatch.setattr(moe_module, "MAX_FORWARDS_PER_STEP", 3)
    tc = tiny_transformer_config(num_layers=1, hidden_size=H, num_attention_heads=2,
                                 num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=8,
                                 moe_router_score_function="sigmoid")
    layer = MegatronMoELayer(tc, moe=moe_config_from_transformer_config(
        tc, {"balancing": {"methods": "bias"}}))
    assert layer.router.step_owner is StepOwner.NEXT_FORWARD
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            layer(torch.randn(S, B, H))
    notes = [str(w.message) for w in caught if "without the end of a step" in str(w.message)]
    assert len(notes) == 1 and "step_balancing(model)" in notes[0], notes
