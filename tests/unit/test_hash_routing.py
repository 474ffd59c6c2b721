"""Hash routing (`router.kind: hash`) against transformers' DeepSeek-V4 MoE block in its hash
layers (`DeepseekV4SparseMoeBlock`, `mlp_layer_types == "hash_moe"`) on the same weights and
table: the output and its gradients, at EP=1 and EP=2 (mock ranks), and under sequence
parallelism's split of the token ids; Roller et al.'s equal gates; the table saved and loaded
with the model; and the refusals of tables and ids that do not fit."""
import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

from megamoe import ConfigError, MoEConfig
from megamoe.errors import DataError
from megamoe.layer import MoELayer
from megamoe.routing.token_ids import capture_input_ids, routing_token_ids
from mock_ranks import run_ranks

D, F, E, K, V, B, S, SCALE = 16, 8, 8, 2, 50, 2, 12, 1.5


def v4_block() -> DeepseekV4SparseMoeBlock:
    """DeepSeek-V4's hash MoE layer, its clamps out of reach (plain SwiGLU)."""
    config = DeepseekV4Config(hidden_size=D, intermediate_size=F, num_hidden_layers=1,
                              num_local_experts=E, num_experts_per_tok=K, vocab_size=V,
                              mlp_layer_types=["hash_moe"], swiglu_limit=1e9,
                              routed_scaling_factor=SCALE)
    torch.manual_seed(0)
    block = DeepseekV4SparseMoeBlock(config, 0).float()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.4)
        block.gate.tid2eid.copy_(torch.rand(V, E, generator=torch.Generator().manual_seed(7))
                                 .topk(K).indices)
    return block


def hash_config(**router) -> MoEConfig:
    return MoEConfig.from_dict({
        "hidden_size": D, "num_experts": E, "ffn_hidden_size": F, "topk": K,
        "router": {"kind": "hash", "vocab_size": V, "score_function": "sqrtsoftplus",
                   "topk_scaling_factor": SCALE, **router},
        "balancing": {"methods": "none"}, "shared_expert": {"ffn_hidden_size": F}})


def hash_layer(block, ep_comm=None, experts=slice(None), **router) -> MoELayer:
    layer = MoELayer(hash_config(**router), ep_comm=ep_comm)
    shared = block.shared_experts
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.router.tid2eid.copy_(block.gate.tid2eid)
        layer.experts.fc1_weight.copy_(block.experts.gate_up_proj[experts])
        layer.experts.fc2_weight.copy_(block.experts.down_proj[experts])
        layer.shared_experts.linear_fc1.weight.copy_(
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        layer.shared_experts.linear_fc2.weight.copy_(shared.down_proj.weight)
    return layer


def batch():
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(2))
    weights = torch.randn(B, S, D, generator=torch.Generator().manual_seed(3))
    return ids, x, weights


def reference(block):
    ids, x, weights = batch()
    leaf = x.clone().requires_grad_()
    out = block(leaf, ids)
    (out * weights).sum().backward()
    return out.detach(), leaf.grad, block.gate.weight.grad, block.experts.gate_up_proj.grad


def run(layer, ids_BS, x_BSD, weights_BSD):
    """megamoe's [S, B, D] layout, back in [B, S, D]."""
    leaf = x_BSD.clone().requires_grad_()
    with routing_token_ids(ids_BS):
        out = layer(leaf.transpose(0, 1))[0].transpose(0, 1)
    (out * weights_BSD).sum().backward()
    return out.detach(), leaf.grad


def test_hash_layer_equals_deepseek_v4():
    block = v4_block()
    expected, expected_dx, expected_router, expected_fc1 = reference(block)
    layer = hash_layer(block)
    out, dx = run(layer, *batch())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, expected_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.router.weight.grad, expected_router, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.experts.fc1_weight.grad, expected_fc1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", ["expert", "sequence"])
def test_hash_layer_equals_deepseek_v4_on_two_ranks(split):
    """EP=2: each rank its sequences and half the experts. Sequence parallelism (the token
    group of two tensor-parallel ranks): each rank half the positions of every sequence, and
    the ids of its own positions."""
    block = v4_block()
    expected, expected_dx, _, _ = reference(block)
    ids, x, weights = batch()

    def rank_run(comm):
        if split == "expert":
            layer = hash_layer(block, comm, slice(comm.rank * E // 2, (comm.rank + 1) * E // 2))
            mine = slice(comm.rank, comm.rank + 1)
            return run(layer, ids[mine], x[mine], weights[mine])
        layer = hash_layer(block)
        layer.token_comm = comm
        half = slice(comm.rank * S // 2, (comm.rank + 1) * S // 2)
        return run(layer, ids, x[:, half], weights[:, half])

    results = run_ranks(2, rank_run)
    dim = 0 if split == "expert" else 1
    torch.testing.assert_close(torch.cat([r[0] for r in results], dim), expected, rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(torch.cat([r[1] for r in results], dim), expected_dx, rtol=1e-5,
                               atol=1e-6)


def test_equal_gates_send_each_token_to_its_table_experts_at_1_over_k():
    block = v4_block()
    layer = hash_layer(block, gates="equal", topk_scaling_factor=None)
    ids, x, _ = batch()
    seen = []
    layer.router.register_forward_hook(lambda mod, args, out: seen.append(out))
    with routing_token_ids(ids):
        layer(x.transpose(0, 1))
    table_experts = block.gate.tid2eid[ids.t().reshape(-1)]
    expected = torch.zeros(S * B, E).scatter_(1, table_experts, 1.0 / K)
    assert torch.equal(seen[0].gates_TE, expected)


def test_the_table_is_drawn_from_its_seed_saved_and_checked_on_load():
    layer = MoELayer(hash_config(table_seed=3))
    again = MoELayer(hash_config(table_seed=3))
    other = MoELayer(hash_config(table_seed=4))
    assert torch.equal(layer.router.tid2eid, again.router.tid2eid)
    assert not torch.equal(layer.router.tid2eid, other.router.tid2eid)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.router.tid2eid, layer.router.tid2eid)
    for table, match in [(torch.full((V, K), E), "names experts 8 to 8"),
                         (torch.zeros(V + 1, K, dtype=torch.long), r"shape \(51, 2\)"),
                         (torch.zeros(V, K, dtype=torch.long), "an expert twice")]:
        with pytest.raises(DataError, match=match) as err:
            other.load_state_dict({**layer.state_dict(), "router.tid2eid": table})
        assert "\n" not in str(err.value)


def test_ids_reach_a_gpt_forward_and_missing_ids_are_refused():
    layer = MoELayer(hash_config())
    x = torch.randn(S, B, D)
    with pytest.raises(ConfigError, match="given none: call megamoe.routing.token_ids"):
        layer(x)
    with pytest.raises(DataError, match="token id 50 .* outside the table's vocabulary of 50"):
        with routing_token_ids(torch.full((B, S), V)):
            layer(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = layer

        def forward(self, input_ids, hidden):
            return self.moe(hidden)[0]

    model = Model()
    capture_input_ids(model)
    ids, _, _ = batch()
    out = model(ids, x)
    with routing_token_ids(ids):
        assert torch.equal(out, layer(x)[0])
    assert torch.equal(out, layer(x, token_ids=ids)[0])  # or given to the layer itself


@pytest.mark.parametrize("tree, match", [
    ({"router": {"kind": "hash"}}, "needs the vocabulary"),
    ({"router": {"kind": "hash", "vocab_size": V, "gates": "mean"}}, "router.gates='mean'"),
    ({"router": {"kind": "hash", "vocab_size": V}, "balancing": {"methods": "bias"}},
     "balances by construction"),
])
def test_hash_settings_that_cannot_work_are_refused_in_one_line(tree, match):
    with pytest.raises(ConfigError, match=match) as err:
        MoEConfig.from_dict({"hidden_size": D, "num_experts": E, "ffn_hidden_size": F,
                             "topk": K, **tree})
    assert "\n" not in str(err.value)
