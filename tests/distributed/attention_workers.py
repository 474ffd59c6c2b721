"""Per-rank job of the GPT-OSS attention tensor-parallel test (run through
`megamoe.parallel.spawn`): the trainer's model with GPT-OSS's attention (sinks, a sliding window
on layer 1 only, q/k/v/o biases, YaRN with `truncate: false`; layer 1 dense with MLP biases,
layer 2 MoE) built at TP=2 with sequence parallelism, then at TP=1 in the same processes (data
parallel), from the same seed: the initial weights are layout-invariant, so both are the same
model. Each returns the per-token loss of one batch and its attention parameters' gradients,
whole (TP shards gathered along their partition axis, sequence-parallel gradients summed over
the tensor ranks as Megatron's finalize_model_grads does).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

S, B, VOCAB = 16, 2, 64
MODEL = {"num_layers": 2, "hidden_size": 24, "num_attention_heads": 4, "num_query_groups": 2,
         "kv_channels": 8, "ffn_hidden_size": 16, "seq_length": S, "first_k_dense": 1,
         "position_embedding": "rope", "rotary_base": 150000.0,
         "yarn": {"factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False},
         "add_qkv_bias": True, "add_bias_linear": True, "attention_sinks": True,
         "sliding_window": 4, "sliding_window_layers": [1, 0],
         # the same 64 vocabulary rows at TP1 and TP2 (padded to a multiple of 32 x tensor)
         "make_vocab_size_divisible_by": 32, "init_method_std": 0.2}


def whole_gradient(param: torch.Tensor, tp_group) -> torch.Tensor:
    """`param`'s gradient as one process holds it."""
    grad = param.grad.detach().clone()
    if getattr(param, "tensor_model_parallel", False):
        parts = [torch.empty_like(grad) for _ in range(tp_group.size())]
        dist.all_gather(parts, grad, group=tp_group)
        return torch.cat(parts, dim=param.partition_dim)
    if getattr(param, "sequence_parallel", False):
        dist.all_reduce(grad, group=tp_group)
    return grad


def loss_and_gradients(tensor: int, settings: dict = MODEL) -> dict:
    """The model (`settings`: its model section) at tensor-parallel size `tensor`: per-token
    loss and attention gradients."""
    from megatron.core import parallel_state

    from megamoe.megatron.cpu import cuda_as_cpu
    from megamoe.megatron.masks import causal_attention_mask
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.train.config import config_from_dict
    from megamoe.train.model import build_model, transformer_config

    setup_megatron(tensor_model_parallel_size=tensor, seed=3)
    try:
        config = config_from_dict({"model": settings, "parallel": {"tensor": tensor},
                                   "moe": {"num_experts": 2, "ffn_hidden_size": 8, "topk": 1}})
        (model,) = build_model(config, transformer_config(config, False, False), VOCAB)
        generator = torch.Generator().manual_seed(4)
        tokens = torch.randint(0, VOCAB, (B, S + 1), generator=generator)
        positions = torch.arange(S).expand(B, S)
        with cuda_as_cpu():  # Megatron's tensor-parallel collectives, as the trainer runs them
            loss = model(tokens[:, :-1], positions, causal_attention_mask(S),
                         labels=tokens[:, 1:])
            loss.sum().backward()
        group = parallel_state.get_tensor_model_parallel_group()
        grads = {name: whole_gradient(param, group) for name, param in model.named_parameters()
                 if "self_attention" in name}
        return {"loss": loss.detach(), "grads": grads}
    finally:
        teardown_megatron()


def tp_job(rank: int, world_size: int, settings: dict = MODEL) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")
    return {"tp2": loss_and_gradients(world_size, settings),
            "tp1": loss_and_gradients(1, settings)}
