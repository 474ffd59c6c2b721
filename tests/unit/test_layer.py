"""The MoE layer against a naive per-token loop, and at mock EP=N against EP=1."""
import pytest
import torch

from megamoe import MoEConfig
from megamoe.layer import MoELayer
from megamoe.settings import deep_merge
from megamoe.parallel import SingleComm
from mock_ranks import expert_parallel_replica, run_ranks

from reference import naive_capacity_keep, naive_moe, naive_top_p, naive_topk

D = 16


def make_layer(**changes):
    """A layer of the tiny config with nested `changes` (e.g. router={"kind": "top_p"})."""
    torch.manual_seed(0)
    base = dict(hidden_size=D, num_experts=8, ffn_hidden_size=24, topk=2,
                balancing={"methods": "aux_loss"})
    return MoELayer(MoEConfig.from_dict(deep_merge(base, changes)))


def chosen_and_gates(layer, x_TD):
    routing = layer.router(x_TD)
    chosen = [torch.nonzero(r).flatten().tolist() for r in routing.routing_map_TE]
    gates = routing.gates_TE.detach().tolist()
    return chosen, gates


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "squared_relu"])
@pytest.mark.parametrize("router_type", ["topk", "top_p"])
def test_layer_matches_naive_loop(activation, router_type):
    layer = make_layer(experts={"activation": activation}, router={"kind": router_type})
    x = torch.randn(10, 3, D)
    out, bias = layer(x)
    assert bias is None
    x_TD = x.reshape(-1, D)
    logits = x_TD @ layer.router.weight.detach().t()
    probs = logits.softmax(-1)
    chosen = naive_topk(probs, 2) if router_type == "topk" else naive_top_p(probs.double(), 0.4)
    if router_type == "topk":  # softmax after selection
        gates = [{e: float(probs[t, e]) / sum(float(probs[t, c]) for c in cs) for e in cs}
                 for t, cs in enumerate(chosen)]
    else:
        gates = [{e: float(probs[t, e]) for e in cs} for t, cs in enumerate(chosen)]
    expected = naive_moe(x_TD, chosen, gates, layer.experts.fc1_weight.detach(),
                         layer.experts.fc2_weight.detach(), activation)
    torch.testing.assert_close(out.detach().reshape(-1, D), expected, rtol=1e-5, atol=1e-6)


def test_shared_expert_with_gate_is_added():
    layer = make_layer(shared_expert={"ffn_hidden_size": 20, "gate": True})
    x = torch.randn(5, 2, D)
    out, _ = layer(x)
    x_TD = x.reshape(-1, D)
    chosen, gates = chosen_and_gates(layer, x_TD)
    routed = naive_moe(x_TD, chosen, gates, layer.experts.fc1_weight.detach(),
                       layer.experts.fc2_weight.detach(), "swiglu")
    shared = layer.shared_experts
    gate = torch.sigmoid(x_TD @ shared.gate_weight.detach().t())
    from reference import naive_expert
    shared_out = torch.stack([naive_expert(x_TD[t], shared.linear_fc1.weight.detach(),
                                           shared.linear_fc2.weight.detach(), "swiglu")
                              for t in range(x_TD.shape[0])])
    torch.testing.assert_close(out.detach().reshape(-1, D), routed + gate * shared_out,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_exactly_what_the_policy_says(policy):
    layer = make_layer(dispatcher={"capacity_factor": 0.5, "drop_policy": policy},
                       router={"score_function": "sigmoid"})
    x = torch.randn(40, 1, D)
    x_TD = x.reshape(-1, D)
    out, _ = layer(x)
    routing = layer.router(x_TD)
    chosen = [torch.nonzero(r).flatten().tolist() for r in routing.selected_TE]
    gates = routing.gates_TE.detach().tolist()
    kept = naive_capacity_keep(chosen, gates, 8, 0.5, policy)
    kept_chosen = [[e for e in cs if (t, e) in kept] for t, cs in enumerate(chosen)]
    expected = naive_moe(x_TD, kept_chosen, gates, layer.experts.fc1_weight.detach(),
                         layer.experts.fc2_weight.detach(), "swiglu")
    torch.testing.assert_close(out.detach().reshape(-1, D), expected, rtol=1e-5, atol=1e-6)
    assert len(kept) < sum(len(c) for c in chosen)  # something was dropped


def test_padding_tokens_go_to_no_expert():
    layer = make_layer(shared_expert={"ffn_hidden_size": 8})
    x = torch.randn(6, 2, D)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True  # sequence 1, last two positions
    out, _ = layer(x, padding_mask=padding)
    shared_only = layer.shared_experts(x[4:, 1])
    torch.testing.assert_close(out[4:, 1], shared_only)
    assert float(layer.router.load.stats.tokens) == 10  # real tokens counted


EP_CASES = {
    "topk": dict(),
    "group_limited": dict(router={"num_groups": 4, "groups_per_token": 2,
                                  "score_function": "sigmoid"}, balancing={"methods": "bias"}),
    "top_p": dict(router={"kind": "top_p"}),
    "capacity": dict(dispatcher={"capacity_factor": 0.75}),
    "shared_seq_aux": dict(shared_expert={"ffn_hidden_size": 12},
                           balancing={"methods": "seq_aux_loss", "z_loss_coeff": 1e-2}),
    "threshold": dict(router={"kind": "threshold"}, topk=1, balancing={"methods": "none"},
                      shared_expert={"ffn_hidden_size": 12}),
    "erc_adaptive_norm": dict(balancing={"methods": "adaptive_aux_loss", "erc_loss_coeff": 0.5,
                                         "erc_noise": 0.0},
                              router={"gate_logit_norm": 1.0}, dispatcher={"capacity_factor": 1.0}),
}


def run_replicas(layer, ranks, x, grad_out, expert_parallel):
    """Each of `ranks` data-parallel ranks runs its micro-batch through a replica of `layer`,
    with the experts split over the ranks (expert_parallel) or all experts on every rank."""

    def rank(comm):
        ep_comm = comm if expert_parallel else SingleComm()
        replica = expert_parallel_replica(layer, ep_comm, replica_comm=comm)
        xr = x[comm.rank].clone().requires_grad_()
        out, _ = replica(xr)
        (out * grad_out[comm.rank]).sum().backward()
        return out.detach(), xr.grad, {n: p.grad for n, p in replica.named_parameters()}

    return run_ranks(ranks, rank)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("case", list(EP_CASES))
def test_mock_expert_parallel_equals_single_process(ep, case):
    """EP=N equals EP=1 (same data-parallel ranks and micro-batches, so the same global counts
    for the aux loss): outputs, input gradients and every parameter gradient."""
    layer = make_layer(**EP_CASES[case])
    torch.manual_seed(1)
    x = torch.randn(ep, 6, 2, D)  # one micro-batch per rank
    grad_out = torch.randn(ep, 6, 2, D)
    reference = run_replicas(layer, ep, x, grad_out, expert_parallel=False)
    results = run_replicas(layer, ep, x, grad_out, expert_parallel=True)
    for (out, input_grad, _), (ref_out, ref_input_grad, _) in zip(results, reference):
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(input_grad, ref_input_grad, rtol=1e-5, atol=1e-5)
    for name, _ in layer.named_parameters():
        expected = sum(ref[2][name] for ref in reference)
        grads = [res[2][name] for res in results]
        got = torch.cat(grads) if name.startswith("experts.") else sum(grads)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if EP_CASES[case].get("balancing", {}).get("methods") != "aux_loss":  # no cross-rank loss: EP=1 on one process
        for r in range(ep):
            torch.testing.assert_close(results[r][0], layer(x[r])[0].detach(),
                                       rtol=1e-5, atol=1e-5)


def test_mock_rank_receiving_zero_tokens():
    layer = make_layer(topk=1, balancing={"methods": "none"})
    with torch.no_grad():  # every token prefers experts 0..3, which live on rank 0 of 2
        layer.router.weight[4:] = -10.0
        layer.router.weight[:4] = layer.router.weight[:4].abs()
    x = torch.rand(2, 5, 2, D)
    ref = [layer(x[r])[0].detach() for r in range(2)]

    def rank(comm):
        replica = expert_parallel_replica(layer, comm)
        rows_ND, tokens_per_expert, _ = replica.dispatcher.dispatch(
            x[comm.rank].reshape(-1, D), replica.router(x[comm.rank].reshape(-1, D)))
        out, _ = replica(x[comm.rank].requires_grad_())
        out.sum().backward()
        return out.detach(), rows_ND.shape[0]

    results = run_ranks(2, rank)
    assert results[1][1] == 0  # rank 1 received no tokens
    for r in range(2):
        torch.testing.assert_close(results[r][0], ref[r], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_on_cuda_matches_cpu(dtype):
    """The layer on CUDA (grouped GEMM, as on CPU) against the fp32 CPU layer
    (which gets the same dtype-rounded weights and input, so routing decisions agree)."""
    layer = make_layer(shared_expert={"ffn_hidden_size": 32}, num_experts=8, topk=2)
    layer.load_state_dict({k: v.to(dtype).float() for k, v in layer.state_dict().items()})
    x = torch.randn(64, 4, D).to(dtype)
    ref, _ = layer(x.float())
    ref.sum().backward()
    cuda_layer = make_layer(shared_expert={"ffn_hidden_size": 32}, num_experts=8, topk=2)
    cuda_layer.load_state_dict(layer.state_dict())
    cuda_layer.to("cuda", dtype)
    out, _ = cuda_layer(x.to("cuda"))
    out.float().sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float().cpu(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(cuda_layer.experts.fc1_weight.grad.float().cpu(),
                               layer.experts.fc1_weight.grad, rtol=tol, atol=tol)
