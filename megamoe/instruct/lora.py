"""LoRA on Megatron-Core's parallel linears: the low-rank fine-tuning baseline of the SIMoE study.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv 2106.09685): W = W0 +
(alpha / r) B A with W0 frozen, A [r, I] Gaussian and B [O, r] zero (the start is the dense
model). The low-rank update is formed as a weight and run through Megatron-Core's own partition
product, so tensor parallelism splits it as it splits W0: a column-parallel layer splits B's rows
and keeps A whole, a row-parallel layer splits A's columns and keeps B whole; the whole factor's
gradient is the sum over the tensor-parallel group.
"""
from __future__ import annotations

import math

from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from megamoe.megatron.linear_specs import local_block_spec_with
from megamoe.simoe.interpolated import input_columns, replicated_randn

TRAINABLE_SUFFIXES = ("lora_a", "lora_b")


class _LowRank:
    _split_columns: bool

    def _make_low_rank(self, rank: int, alpha: float) -> None:
        self.weight.requires_grad_(False)
        rows = self.weight.shape[0]
        columns, shard = input_columns(self.weight, self.tp_group, self._split_columns)
        self.lora_a = nn.Parameter(replicated_randn((rank, columns), 1.0 / math.sqrt(columns),
                                                    shard, self.weight))
        self.lora_b = nn.Parameter(self.weight.new_zeros(rows, rank))
        if self._split_columns:
            set_tensor_model_parallel_attributes(self.lora_a, True, 1, 1)
        else:
            set_tensor_model_parallel_attributes(self.lora_b, True, 0, 1)
        self.lora_scale = alpha / rank

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 - Megatron's names
        frozen = super()._forward_impl(input, weight, *args, **kwargs)
        a, b = self.lora_a, self.lora_b
        if self.tp_group.size() > 1:  # the whole factor reads every rank's gradient
            if self._split_columns:
                b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)
            else:
                a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
        kwargs["bias"] = None
        return frozen + super()._forward_impl(input, (b @ a) * self.lora_scale, *args, **kwargs)


class LoRAColumnParallelLinear(_LowRank, ColumnParallelLinear):
    _split_columns = False

    def __init__(self, *args, lora_rank: int, lora_alpha: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._make_low_rank(lora_rank, lora_alpha)


class LoRARowParallelLinear(_LowRank, RowParallelLinear):
    _split_columns = True

    def __init__(self, *args, lora_rank: int, lora_alpha: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._make_low_rank(lora_rank, lora_alpha)


def lora_gpt(config: TransformerConfig, rank: int, alpha: float, vocab_size: int,
             max_sequence_length: int, **gpt_kwargs) -> GPTModel:
    """A GPTModel with LoRA on every QKV, attention-output, fc1 and fc2 linear; only the LoRA
    factors train (the dense seed's weights load under their usual names)."""
    params = {"lora_rank": rank, "lora_alpha": alpha}
    spec = local_block_spec_with(config,
                                 column=ModuleSpec(module=LoRAColumnParallelLinear, params=params),
                                 row=ModuleSpec(module=LoRARowParallelLinear, params=params))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=max_sequence_length, **gpt_kwargs)
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(TRAINABLE_SUFFIXES))
    return model


def rank_matching(model: nn.Module, parameters: int) -> int:
    """The LoRA rank whose factors hold about `parameters` (e.g. SIMoE's delta) when LoRA wraps
    every decoder linear of `model` (local shapes, so at tensor-parallel size 1 the whole)."""
    per_rank = sum(sum(m.weight.shape) for name, m in model.named_modules()
                   if name.startswith("decoder.")
                   and isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    return max(1, round(parameters / per_rank))
