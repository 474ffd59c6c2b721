"""DeepSpeed-MoE's own MoE layer on CPU (`deepspeed.moe.layer.MoE` with Megatron-DeepSpeed's
expert MLP): the reference that `tools/import_deepspeed_moe.py --verify` and the benchmarks compare
megamoe's layer with. Reading its checkpoints: `megamoe.checkpointing.deepspeed_source`.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class MegatronDeepSpeedMLP(nn.Module):
    """Megatron-DeepSpeed's expert MLP (ParallelMLP at TP=1, no biases): dense_h_to_4h ->
    activation (GELU, or SwiGLU over its two halves) -> dense_4h_to_h."""

    def __init__(self, hidden: int, ffn: int, activation: str):
        super().__init__()
        self.swiglu = activation == "swiglu"
        self.dense_h_to_4h = nn.Linear(hidden, ffn * (2 if self.swiglu else 1), bias=False)
        self.dense_4h_to_h = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense_h_to_4h(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.dense_4h_to_h(h)


def init_deepspeed_comm() -> None:
    """deepspeed.comm over the existing (or a new single-process) gloo group, without
    JIT-compiling DeepSpeed's shared-memory allreduce op (`build_shm_op`, minutes of C++ build
    on a CPU machine, and unused here)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not torch.distributed.is_initialized():
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"),
                            ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(name, value)
    deepspeed.init_distributed(dist_backend="gloo")


def deepspeed_moe_layer(hidden: int, ffn: int, num_experts: int, topk: int, activation: str,
                        standalone: bool = True) -> nn.Module:
    """`deepspeed.moe.layer.MoE` in its dropless, deterministic configuration, with Megatron-
    DeepSpeed's expert MLP; call `init_deepspeed_comm()` first. standalone: set up its expert
    groups now (False when `deepspeed.initialize` will)."""
    from deepspeed.moe.layer import MoE

    layer = MoE(hidden, MegatronDeepSpeedMLP(hidden, ffn, activation), num_experts=num_experts,
                ep_size=1, k=topk, drop_tokens=False, use_rts=False,
                top2_2nd_expert_sampling=False)
    if standalone:
        layer.set_deepspeed_parallelism()
    return layer
