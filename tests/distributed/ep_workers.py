"""Per-rank jobs of the multi-process expert-parallel tests (run through `megamoe.parallel.spawn`).

With world size R every job runs expert parallelism EP=R (data parallelism R for the dense part,
as Megatron folds EP into DP). The references are independent of the code under test: a
single-process EP=1 layer computed in the same process on the whole global batch, or values
another world size returns, compared by the tests.
"""
from __future__ import annotations

import os
import signal
import time
import zlib

import torch
import torch.nn.functional as F

S, D = 4, 16  # sequence length and hidden size of the layer-level checks


def _setup(world_size: int, timeout_s: float = 120.0):
    from megamoe.megatron.runtime import setup_megatron
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    setup_megatron(expert_model_parallel_size=world_size, timeout_s=timeout_s, seed=1234)
    return get_default_pg_collection()


# ---------------------------------------------------------------------------------------------
# MoE layer at EP=R against EP=1


LAYER_CASES = {
    "topk_global_aux": dict(balancing={"methods": "global_aux_loss", "z_loss_coeff": 1e-2}),
    "group_limited_bias": dict(router={"score_function": "sigmoid", "num_groups": 4,
                                       "groups_per_token": 2, "topk_scaling_factor": 2.5},
                               topk=4, balancing={"methods": "bias"}),
    "top_p": dict(router={"kind": "top_p", "threshold": 0.6, "entropy_loss_coeff": 1e-2},
                  balancing={"methods": "global_aux_loss"}),
    "capacity_probs": dict(dispatcher={"capacity_factor": 1.0, "drop_policy": "probs"}),
    "capacity_position": dict(dispatcher={"capacity_factor": 0.6, "drop_policy": "position"},
                              topk=3),
    "shared_gate_seq_aux": dict(shared_expert={"ffn_hidden_size": 12, "gate": True},
                                balancing={"methods": "seq_aux_loss"}),
    "uneven_and_empty_rank": dict(),
    "zero_tokens_to_last_rank": dict(),
    "gpt_oss_biases_clamped_swiglu": dict(router={"bias": True}, topk=3, experts={
        "activation": "clamped_swiglu", "swiglu_limit": 0.5, "bias": True}),
}


def _sequences_per_rank(case: str, R: int) -> list[int]:
    if case == "uneven_and_empty_rank":
        return [(3 * r) % (R + 1) for r in range(R)]  # R=2: [0, 3]; R=4: [0, 3, 1, 4]
    return [2] * R


def _layer_case(case: str, dispatcher: str, ep_comm, replica_comm) -> dict:
    """(got, expected) pairs of one case on this rank: output, input gradient, and the router,
    expert and shared-expert gradients (summed over ranks where parameters are replicated)."""
    from megamoe import MoEConfig
    from megamoe.layer import MoELayer
    from megamoe.settings import deep_merge
    from mock_ranks import expert_parallel_replica

    R, rank = ep_comm.size, ep_comm.rank
    cfg = MoEConfig.from_dict(deep_merge(
        dict(hidden_size=D, num_experts=8, ffn_hidden_size=12, topk=2, init_method_std=0.3,
             balancing={"methods": "none"}, dispatcher={"kind": dispatcher}),
        LAYER_CASES[case]))
    L = cfg.num_experts // R
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    torch.manual_seed(zlib.crc32(case.encode()))
    reference = MoELayer(cfg)
    sizes = _sequences_per_rank(case, R)
    x = torch.randn(S, sum(sizes), D, generator=gen)
    w = torch.randn(S, sum(sizes), D, generator=gen)
    with torch.no_grad():
        if cfg.balancing.uses_expert_bias:
            reference.router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen) * 0.1)
        for bias in (reference.router.bias, reference.experts.fc1_bias,
                     reference.experts.fc2_bias):
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
        if case == "zero_tokens_to_last_rank":
            x = x.abs()  # positive inputs, so negative router rows lose every token
            reference.router.weight[-L:] = -1.0

    x_ref = x.clone().requires_grad_()
    if cfg.dispatcher.capacity_factor is None:
        y_ref = reference(x_ref)[0]
    else:  # capacity is per forward call, i.e. per rank: the reference runs each rank's shard
        y_ref = torch.cat([reference(shard)[0] for shard in x_ref.split(sizes, dim=1)], dim=1)
    (y_ref * w).sum().backward()

    replica = expert_parallel_replica(reference, ep_comm, replica_comm)
    # The balance losses weigh like each rank's share of the main loss; summed over R ranks =
    # the reference.
    replica.balance_loss_scale = 1.0 / R
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    x_ep = x[:, mine].clone().requires_grad_()
    y_ep = replica(x_ep)[0]
    (y_ep * w[:, mine]).sum().backward()

    def summed(grad):
        grad = grad.clone()
        replica_comm.all_reduce(grad)
        return grad

    experts = slice(rank * L, (rank + 1) * L)
    pairs = {
        "output": (y_ep.detach(), y_ref.detach()[:, mine]),
        "input_grad": (x_ep.grad, x_ref.grad[:, mine]),
        "router_grad": (summed(replica.router.weight.grad), reference.router.weight.grad),
        "fc1_grad": (replica.experts.fc1_weight.grad, reference.experts.fc1_weight.grad[experts]),
        "fc2_grad": (replica.experts.fc2_weight.grad, reference.experts.fc2_weight.grad[experts]),
    }
    if reference.router.bias is not None:
        pairs["router_bias_grad"] = (summed(replica.router.bias.grad), reference.router.bias.grad)
    if reference.experts.fc1_bias is not None:
        for name in ("fc1_bias", "fc2_bias"):
            pairs[f"{name}_grad"] = (getattr(replica.experts, name).grad,
                                     getattr(reference.experts, name).grad.view(
                                         cfg.num_experts, -1)[experts].reshape(-1))
    if reference.shared_experts is not None:
        pairs["shared_fc1_grad"] = (summed(replica.shared_experts.linear_fc1.weight.grad),
                                    reference.shared_experts.linear_fc1.weight.grad)
        pairs["shared_gate_grad"] = (summed(replica.shared_experts.gate_weight.grad),
                                     reference.shared_experts.gate_weight.grad)
    routed = reference.router(x.reshape(-1, D)).routing_map_TE
    return {"pairs": pairs, "tokens_to_last_rank": int(routed[:, -L:].sum()),
            "tokens_per_rank": sizes}


def _bias_balancing(ep_comm, replica_comm, steps: int = 25) -> dict:
    """Loss-free balancing at EP=R: with frozen weights the biases follow EP=1 on the global
    batch exactly; while training on different data per rank they stay identical on all ranks."""
    from megamoe import BalancingConfig, MoEConfig, TopKRouterConfig
    from megamoe.balancing import step_balancing
    from megamoe.layer import MoELayer
    from mock_ranks import expert_parallel_replica

    R, rank = ep_comm.size, ep_comm.rank
    cfg = MoEConfig(hidden_size=D, num_experts=8, ffn_hidden_size=12, topk=2, init_method_std=0.3,
                    router=TopKRouterConfig(score_function="sigmoid"),
                    balancing=BalancingConfig(methods="bias", bias_update_rate=1e-2))
    torch.manual_seed(5)
    reference = MoELayer(cfg)
    replica = expert_parallel_replica(reference, ep_comm, replica_comm)
    with torch.no_grad():
        for step in range(steps):
            x = torch.randn(S, 2 * R, D, generator=torch.Generator().manual_seed(step))
            reference(x)
            step_balancing(reference)
            replica(x[:, 2 * rank:2 * rank + 2])
            step_balancing(replica, replica_comm)
    frozen = (replica.router.expert_bias.clone(), reference.router.expert_bias.clone())

    optimizer = torch.optim.SGD(replica.parameters(), lr=0.1)
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * (rank + 1) + step)
        loss = replica(torch.randn(S, 2, D, generator=gen))[0].square().mean()
        loss.backward()
        for name, param in replica.named_parameters():
            if not name.startswith("experts."):  # replicated: average over the replica group
                replica_comm.all_reduce(param.grad)
                param.grad /= R
        optimizer.step()
        optimizer.zero_grad()
        step_balancing(replica, replica_comm)
    return {"frozen": frozen,
            "biases": torch.stack(replica_comm.all_gather(replica.router.expert_bias)),
            "router_weights": torch.stack(replica_comm.all_gather(replica.router.weight.detach()))}


def _layer_part(pgs, rank: int, world_size: int, ckpt_dir: str) -> dict:
    """Every layer case with both dispatchers, and the bias checks."""
    from megamoe.parallel import TorchComm

    ep_comm, replica_comm = TorchComm(pgs.ep), TorchComm(pgs.tp_dp_cp)
    cases = {f"{case}/{dispatcher}": _layer_case(case, dispatcher, ep_comm, replica_comm)
             for case in LAYER_CASES for dispatcher in ("alltoall", "allgather")}
    return {"cases": cases, "bias": _bias_balancing(ep_comm, replica_comm)}


# ---------------------------------------------------------------------------------------------
# GPTModels of megamoe and Megatron-Core layers


VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 4


def _gpt_config(**changes):
    from tiny_models import tiny_transformer_config

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=24,
                gated_linear_unit=True, activation_func=F.silu,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                moe_token_dispatcher_type="alltoall")
    return tiny_transformer_config(**{**base, **changes})


def _fill_weights(model, ep_rank: int, seed: int) -> None:
    """Set every matrix from a generator keyed by its name, and each expert's weights by the
    expert's GLOBAL id, for megamoe (stacked `experts.fc{1,2}_weight`) and Megatron
    (`experts.local_experts.{i}.linear_fc{1,2}.weight`) alike: the same model at any EP size."""
    def draw(key: str, shape) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
        return torch.randn(shape, generator=gen) * 0.05

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.fc1_weight", "experts.fc2_weight")):
                layer, fc = name.rsplit(".experts.", 1)
                L = param.shape[0]
                for i in range(L):
                    param[i] = draw(f"{layer}.expert{ep_rank * L + i}.{fc[:3]}", param.shape[1:])
            elif ".local_experts." in name:
                layer, rest = name.split(".experts.local_experts.")
                i, fc = int(rest.split(".")[0]), rest.split(".")[1].replace("linear_", "")
                L = len(model.get_submodule(f"{layer}.experts.local_experts"))
                param.copy_(draw(f"{layer}.expert{ep_rank * L + i}.{fc}", param.shape))
            elif param.dim() >= 2:
                param.copy_(draw(name, param.shape))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(draw(name, buffer.shape).abs() * 0.2)


def _lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=gen)
    tokens = (start + 3 * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def _megamoe_gpt(config, layer_overrides=None):
    from tiny_models import build_gpt
    from megamoe.megatron.specs import gpt_decoder_block_spec

    spec = gpt_decoder_block_spec(config, layer_overrides=layer_overrides)
    return build_gpt(config, spec, vocab_size=VOCAB, seq_len=SEQ)


def _megatron_gpt(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tiny_models import build_gpt

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return build_gpt(config, spec, vocab_size=VOCAB, seq_len=SEQ)


# ---------------------------------------------------------------------------------------------
# Checkpoints: save at EP=2, load at EP=1 and EP=4, megamoe <-> Megatron-Core


def _logits(model) -> torch.Tensor:
    from megamoe.megatron.masks import causal_attention_mask

    model.eval()
    tokens, _ = _lm_batch(12345)
    with torch.no_grad():
        return model(tokens, torch.arange(SEQ).expand(GLOBAL_BATCH, -1),
                     causal_attention_mask(SEQ))


def _experts_by_global_id(model, ep_rank: int) -> dict:
    """{'layer.expert{g}': fc1 weight} of this rank's megamoe experts."""
    out = {}
    for name, param in model.named_parameters():
        if name.endswith("experts.fc1_weight"):
            L = param.shape[0]
            for i in range(L):
                out[f"{name.split('.mlp.')[0]}.expert{ep_rank * L + i}"] = param[i].detach().clone()
    return out


def _checkpoint_layout(sharded: dict) -> dict:
    """key -> sorted (type, global shape, global offset, fragmentation, replica) of every
    ShardedTensor/Object a sharded state dict describes (factories built), MoE layers only."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    def leaves(value):
        if isinstance(value, (list, tuple)):
            for item in value:
                yield from leaves(item)
        else:
            yield value

    layout: dict = {}
    for value in sharded.values():
        items = value.build() if isinstance(value, ShardedTensorFactory) else value
        for item in leaves(items):
            if ".mlp." in item.key:
                layout.setdefault(item.key, []).append(str((
                    type(item).__name__, tuple(item.global_shape), tuple(item.global_offset),
                    tuple(getattr(item, "axis_fragmentations", None) or ()), item.replica_id)))
    return {key: sorted(entries) for key, entries in layout.items()}


MODEL_BUILDERS = {"megamoe": _megamoe_gpt, "megatron": _megatron_gpt}


def _build(kind: str):
    return MODEL_BUILDERS[kind](_gpt_config())


def _save_part(pgs, rank: int, world_size: int, ckpt_dir: str) -> dict:
    """At EP=world_size: build megamoe and Megatron models, save both (megamoe also with
    singleton local shards); return their logits, megamoe's experts by global id, and whether
    the two models describe identical checkpoint layouts."""
    from megatron.core import dist_checkpointing

    out = {"layout_mismatch": {}}
    models = {}
    for kind, seed in (("megamoe", 1), ("megatron", 2)):
        model = _build(kind)
        _fill_weights(model, pgs.ep.rank(), seed)
        models[kind] = model
        dist_checkpointing.save(model.sharded_state_dict(), _ckpt_path(ckpt_dir, kind))
        out[f"{kind}_logits"] = _logits(model)
    dist_checkpointing.save(models["megamoe"].sharded_state_dict(
        metadata={"singleton_local_shards": True}), _ckpt_path(ckpt_dir, "megamoe_singleton"))
    out["experts"] = _experts_by_global_id(models["megamoe"], pgs.ep.rank())
    for variant, metadata in (("default", {}), ("singleton", {"singleton_local_shards": True})):
        mine = _checkpoint_layout(models["megamoe"].sharded_state_dict(metadata=dict(metadata)))
        theirs = _checkpoint_layout(models["megatron"].sharded_state_dict(metadata=dict(metadata)))
        out["layout_mismatch"][variant] = sorted(
            key for key in set(mine) | set(theirs) if mine.get(key) != theirs.get(key))
    return out


def _ckpt_path(ckpt_dir: str, name: str) -> str:
    path = os.path.join(ckpt_dir, name)
    os.makedirs(path, exist_ok=True)
    return path


def _load_part(pgs, rank: int, world_size: int, ckpt_dir: str) -> dict:
    """At EP=world_size: load the EP=2 checkpoints into freshly initialised models."""
    from megatron.core import dist_checkpointing

    out = {}
    for model_kind, ckpt, metadata in (("megamoe", "megamoe", None),
                                       ("megamoe", "megamoe_singleton",
                                        {"singleton_local_shards": True}),
                                       ("megamoe", "megatron", None),
                                       ("megatron", "megamoe", None)):
        model = _build(model_kind)
        state = dist_checkpointing.load(model.sharded_state_dict(metadata=metadata),
                                        os.path.join(ckpt_dir, ckpt))
        model.load_state_dict(state)
        out[f"{model_kind}<-{ckpt}"] = _logits(model)
        if model_kind == "megamoe" and ckpt == "megamoe":
            out["experts"] = _experts_by_global_id(model, pgs.ep.rank())
    return out


def _rejects_part(pgs, rank: int, world_size: int, ckpt_dir: str) -> dict:
    """The errors MegatronMoELayer gives for expert tensor parallelism and for tensor
    parallelism without sequence parallelism (a real 2-rank group stands in for each)."""
    import copy

    from megamoe.errors import ConfigError
    from megamoe.megatron.moe_module import MegatronMoELayer

    messages = {}
    for name, field in (("expert_tp", "expt_tp"), ("tp_without_sp", "tp")):
        groups = copy.copy(pgs)
        setattr(groups, field, pgs.ep)
        try:
            MegatronMoELayer(_gpt_config(), pg_collection=groups)
            messages[name] = None
        except ConfigError as err:
            messages[name] = str(err)
    return messages


PARTS = {"layers": _layer_part, "save": _save_part, "load": _load_part,
         "rejects": _rejects_part}


def ep_job(rank: int, world_size: int, parts: list[str], ckpt_dir: str) -> dict:
    """Set up Megatron at EP=world_size once and run the named parts in order (one spawn shares
    the start-up cost of its processes across all of them)."""
    pgs = _setup(world_size)
    return {part: PARTS[part](pgs, rank, world_size, ckpt_dir) for part in parts}


# ---------------------------------------------------------------------------------------------
# A rank dies or stalls mid-step


def failure_job(rank: int, world_size: int, mode: str, group_timeout_s: float,
                result_dir: str) -> dict:
    """Rank 1 is killed (mode 'killed') or stops taking part (mode 'stalled') before the second
    forward; rank 0 reports the error it got and how long it took."""
    from megamoe import BalancingConfig, MoEConfig
    from megamoe.layer import MoELayer
    from megamoe.parallel import TorchComm

    pgs = _setup(world_size, timeout_s=group_timeout_s)
    ep_comm = TorchComm(pgs.ep)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=D, num_experts=4, ffn_hidden_size=8,
                               balancing=BalancingConfig(methods="none")),
                     ep_comm=ep_comm, replica_comm=TorchComm(pgs.tp_dp_cp))
    x = torch.randn(S, 2, D)
    layer(x)[0].sum().backward()  # a healthy first step
    if rank == 1 and mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:  # stalled: alive but absent until rank 0 has reported
        while not os.path.exists(os.path.join(result_dir, "rank0.pt")):
            time.sleep(0.2)
        return {}
    start = time.monotonic()
    try:
        layer(x)[0].sum().backward()
    except Exception as err:  # noqa: BLE001 - the error is the result
        return {"type": type(err).__name__, "message": str(err),
                "elapsed_s": time.monotonic() - start}
    return {"type": None, "message": "", "elapsed_s": time.monotonic() - start}
