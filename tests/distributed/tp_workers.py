"""Per-rank job of the tensor-parallel balance-loss test (run through `megamoe.parallel.spawn`).

Tensor parallelism 2 with sequence parallelism: each rank holds half of every sequence (Megatron
splits the [S, B, D] activations along S). The reference is a single-process megamoe layer with
the same weights on the whole batch, computed on every rank.
"""
from __future__ import annotations

import torch

S, B, D = 8, 3, 16

TP_CASES = {  # nested MoE settings
    "aux_loss": {"balancing": {"methods": "aux_loss", "aux_loss_coeff": 0.5}},
    "seq_aux_loss": {"balancing": {"methods": ["bias", "seq_aux_loss"], "aux_loss_coeff": 0.5},
                     "router": {"score_function": "sigmoid"}},
    "global_aux_loss": {"balancing": {"methods": "global_aux_loss", "aux_loss_coeff": 0.5}},
    "z_loss": {"balancing": {"methods": "none", "z_loss_coeff": 0.5}},
    "entropy_loss": {"balancing": {"methods": "none"},
                     "router": {"kind": "top_p", "entropy_loss_coeff": 0.5}},
}


def router_grads(layer, x_SBD) -> torch.Tensor:
    """The router gradient of the balance losses alone (attached to the layer output)."""
    layer.router.weight.grad = None
    out, _ = layer(x_SBD)
    (out * 0).sum().backward()
    return layer.router.weight.grad.clone()


def tp_job(rank: int, world_size: int) -> dict:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megamoe.layer import MoELayer
    from megamoe.megatron.fields import moe_config_from_transformer_config
    from tiny_models import tiny_transformer_config
    from megamoe.megatron.moe_module import MegatronMoELayer
    from megamoe.megatron.runtime import setup_megatron

    setup_megatron(tensor_model_parallel_size=world_size, seed=7)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    config = tiny_transformer_config(num_layers=1, hidden_size=D, num_attention_heads=2,
                                     num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=8,
                                     tensor_model_parallel_size=world_size,
                                     sequence_parallel=True)
    x = torch.randn(S, B, D, generator=torch.Generator().manual_seed(3))
    mine = x.chunk(world_size, dim=0)[rank]
    out = {}
    for case, settings in TP_CASES.items():
        torch.manual_seed(11)
        layer = MegatronMoELayer(config, moe=moe_config_from_transformer_config(
            config, {**settings, "init_method_std": 0.5}))
        with torch.no_grad():
            layer.router.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
        reference = MoELayer(layer.cfg)
        reference.load_state_dict(layer.state_dict())
        expected = router_grads(reference, x)
        got = router_grads(layer, mine)
        torch.distributed.all_reduce(got, group=layer.pg_collection.tp)  # Megatron's SP sum
        out[case] = {"got": got, "expected": expected,
                     "ratio": float(got.norm() / expected.norm())}
    return out
