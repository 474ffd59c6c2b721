"""Routing replay driven through Megatron-Core's own `RouterReplay` API, as RL frameworks drive
it: a recorded forward replayed bit for bit, given experts replayed with the gates Megatron-Core's
TopKRouter gives them, recomputation in a 1F1B order, registration in layer order, expert
parallelism (mock ranks), and the one-line refusal of records that do not fit."""
import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megamoe import ConfigError, MoEConfig
from megamoe.errors import DataError
from megamoe.layer import MoELayer
from megamoe.megatron.fields import moe_config_from_transformer_config
from megamoe.megatron.moe_module import megatron_router_replay
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from mock_ranks import run_ranks
from tiny_models import tiny_transformer_config

S, B, D, E, K = 8, 2, 16, 8, 2


class ReplayingLayer(MoELayer):
    """The plain layer given Megatron-Core's RouterReplay, as MegatronMoELayer gives it (here
    with mock expert-parallel ranks)."""

    def make_replay(self):
        return megatron_router_replay()


@pytest.fixture(autouse=True)
def fresh_replay_registry():
    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


def replay_layer(ep_comm=None, **router) -> MoELayer:
    cfg = MoEConfig.from_dict({"hidden_size": D, "num_experts": E, "ffn_hidden_size": 8,
                               "topk": K, "router": {"score_function": "sigmoid", "replay": True,
                                                     "topk_scaling_factor": 2.5, **router},
                               "balancing": {"methods": ["bias", "aux_loss"]}})
    torch.manual_seed(0)
    layer = ReplayingLayer(cfg, ep_comm=ep_comm)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-0.1, 0.1, E))
    return layer


def batch(seed: int) -> torch.Tensor:
    return torch.randn(S, B, D, generator=torch.Generator().manual_seed(seed))


def forward_backward(layer, x):
    leaf = x.clone().requires_grad_()
    out = layer(leaf)[0]
    out.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    return out.detach(), leaf.grad, grads


def other_experts(seed: int) -> torch.Tensor:
    """[S*B, K] distinct experts per token that the router would not pick by itself."""
    return torch.rand(S * B, E, generator=torch.Generator().manual_seed(seed)).topk(K).indices


def test_a_replayed_step_equals_the_recorded_one_bit_for_bit():
    layer = replay_layer()
    x = batch(1)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    recorded = forward_backward(layer, x)
    (indices,) = RouterReplay.get_recorded_data()
    assert indices.shape == (S * B, K)
    with torch.no_grad():  # the bias moved on: the router alone now routes otherwise
        layer.router.expert_bias.copy_(torch.linspace(0.5, -0.5, E))
    RouterReplay.clear_global_router_replay_action()
    assert not torch.equal(forward_backward(layer, x)[0], recorded[0])
    RouterReplay.set_replay_data([indices])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replayed = forward_backward(layer, x)
    assert torch.equal(recorded[0], replayed[0]) and torch.equal(recorded[1], replayed[1])
    assert all(torch.equal(a, b) for a, b in zip(recorded[2], replayed[2]))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_given_experts_take_the_gates_megatrons_router_gives_them(score):
    """Megatron-Core's TopKRouter and megamoe's router, both with routing replay, replaying the
    same experts on the same logits: the same routing map and probabilities."""
    setup_megatron(seed=3)
    try:
        settings = dict(moe_router_score_function=score, moe_enable_routing_replay=True,
                        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        if score == "sigmoid":
            settings.update(moe_router_enable_expert_bias=True,
                            moe_router_topk_scaling_factor=2.5)
        tc = tiny_transformer_config(num_layers=1, hidden_size=D, num_attention_heads=2,
                                     num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=8,
                                     **settings)
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        theirs = TopKRouter(tc, pg_collection=get_default_pg_collection())
        ours = ReplayingLayer(moe_config_from_transformer_config(tc)).router
        with torch.no_grad():
            ours.weight.copy_(theirs.weight)
        assert RouterReplay.global_router_replay_instances == [theirs.router_replay, ours.replay]
        given = other_experts(5)
        RouterReplay.set_replay_data([given, given])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        x = batch(2)
        probs, routing_map = theirs(x)
        routing = ours(x.reshape(S * B, D))
        assert torch.equal(routing.selected_TE, routing_map)
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter_(1, given, True))
        torch.testing.assert_close(routing.gates_TE, probs.detach(), rtol=1e-6, atol=1e-7)
    finally:
        teardown_megatron()


def test_recomputation_replays_each_micro_batch_in_a_1f1b_order():
    """Two micro-batches forward, then both backward (as 1F1B interleaves them), the layer under
    activation checkpointing: each recomputation replays its own micro-batch's experts, so the
    gradients are those of the replay without recomputation."""
    layer = replay_layer()
    xs, given = [batch(10), batch(11)], [other_experts(20), other_experts(21)]
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    expected = []
    for x, indices in zip(xs, given):
        RouterReplay.set_replay_data([indices])
        expected.append(forward_backward(layer, x))
    RouterReplay.clear_global_indices()
    outputs = []
    for x, indices in zip(xs, given):
        RouterReplay.set_replay_data([indices])
        leaf = x.clone().requires_grad_()
        outputs.append((leaf, torch.utils.checkpoint.checkpoint(
            lambda h: layer(h)[0], leaf, use_reentrant=False)))
    for (leaf, out), (want_out, want_dx, want_grads) in zip(outputs, expected):
        out.square().sum().backward()
        assert torch.equal(out.detach(), want_out) and torch.equal(leaf.grad, want_dx)
        assert all(torch.equal(p.grad, g) for p, g in zip(layer.parameters(), want_grads))
        layer.zero_grad()


def test_replay_at_ep2_routes_the_same_tokens_to_the_same_experts():
    given = other_experts(30)
    x = batch(31)
    reference = replay_layer()
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    RouterReplay.set_replay_data([given])
    full = reference(x)[0].detach()
    weights = reference.state_dict()
    RouterReplay.clear_global_router_replay_instances()

    def rank_run(comm):
        layer = replay_layer(ep_comm=comm)
        local = E // 2
        own = {k: (v[comm.rank * local:(comm.rank + 1) * local] if k.startswith("experts.")
                   else v) for k, v in weights.items()}
        layer.load_state_dict(own)
        half = slice(comm.rank * S // 2, (comm.rank + 1) * S // 2)  # positions of this rank
        rows = given.view(S, B, K)[half].reshape(-1, K)
        layer.router.replay.set_target_indices(rows)
        layer.router.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return layer(x[half])[0].detach()

    torch.testing.assert_close(torch.cat(run_ranks(2, rank_run)), full, rtol=1e-6, atol=1e-6)


def test_routers_register_in_layer_order():
    """A GPT of 3 MoE layers built through megamoe's spec from Megatron's flags: Megatron's
    global replay list holds their three replays, in layer order."""
    from megamoe.megatron.specs import decoder_block_spec
    from tiny_models import build_gpt

    setup_megatron(seed=4)
    try:
        tc = tiny_transformer_config(num_layers=3, hidden_size=D, num_attention_heads=2,
                                     num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=8,
                                     moe_enable_routing_replay=True)
        model = build_gpt(tc, decoder_block_spec(tc), vocab_size=32, seq_len=S)
        routers = [m.router for m in model.modules() if hasattr(m, "router")
                   and isinstance(m, MoELayer)]
        assert RouterReplay.global_router_replay_instances == [r.replay for r in routers]
        assert [r.layer_number for r in RouterReplay.global_router_replay_instances] == [1, 2, 3]
    finally:
        teardown_megatron()


@pytest.mark.parametrize("indices, match", [
    (torch.zeros(S * B, K + 1, dtype=torch.long), r"shape \(16, 3\) where this forward needs"),
    (torch.zeros(S * B - 1, K, dtype=torch.long), r"shape \(15, 2\)"),
    (torch.full((S * B, K), 0.5), r"where this forward needs integer"),
    (torch.stack([torch.arange(S * B) % E, torch.full((S * B,), E)], 1), "experts 0..7"),
    (torch.zeros(S * B, K, dtype=torch.long), "the same expert twice"),
])
def test_a_record_that_does_not_fit_is_refused_in_one_line(indices, match):
    layer = replay_layer()
    layer.set_layer_number(3)
    RouterReplay.set_replay_data([indices])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(DataError, match=match) as err:
        layer(batch(0))
    assert "MoE layer 3" in str(err.value) and "\n" not in str(err.value)


def test_replay_data_of_the_wrong_layer_count_is_refused():
    replay_layer()
    with pytest.raises(ValueError, match="does not match instances"):
        RouterReplay.set_replay_data([other_experts(0), other_experts(1)])


def test_a_plain_layer_has_no_replay_state_to_record_with():
    cfg = MoEConfig.from_dict({"hidden_size": D, "num_experts": E, "ffn_hidden_size": 8,
                               "router": {"replay": True}})
    with pytest.raises(ConfigError, match="build the layer as megamoe.megatron.MegatronMoELayer"):
        MoELayer(cfg)


def test_only_the_topk_router_replays():
    with pytest.raises(ConfigError, match="router.replay=True with router.kind='top_p'"):
        MoEConfig.from_dict({"hidden_size": D, "num_experts": E, "ffn_hidden_size": 8,
                             "router": {"kind": "top_p", "replay": True}})
