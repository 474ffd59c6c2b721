"""Save a Megatron-DeepSpeed-shaped MoE GPT with DeepSpeed's own `engine.save_checkpoint`, so
the per-expert file layout is DeepSpeed's, not a copy of it.

    python tests/deepspeed_ckpt.py OUT_DIR TOPK ACTIVATION

Layers 0 and 2 are MoE (`deepspeed.moe.layer.MoE`, 4 experts), layer 1 dense, with the
parameter names of Megatron-DeepSpeed's GPTModel (`language_model.encoder.layers.{L}...`).
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from megamoe.interop.deepspeed_moe import (MegatronDeepSpeedMLP, deepspeed_moe_layer,
                                           init_deepspeed_comm)

HIDDEN, FFN, EXPERTS, VOCAB = 16, 32, 4, 64


class Layer(nn.Module):
    def __init__(self, moe: bool, topk: int, activation: str):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = (deepspeed_moe_layer(HIDDEN, FFN, EXPERTS, topk, activation, standalone=False) if moe
                    else MegatronDeepSpeedMLP(HIDDEN, FFN, activation))


class Encoder(nn.Module):
    def __init__(self, topk: int, activation: str):
        super().__init__()
        self.layers = nn.ModuleList(Layer(i % 2 == 0, topk, activation) for i in range(3))
        self.final_layernorm = nn.LayerNorm(HIDDEN)


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)


class LanguageModel(nn.Module):
    def __init__(self, topk: int, activation: str):
        super().__init__()
        self.embedding = Embedding()
        self.encoder = Encoder(topk, activation)


class GPTModel(nn.Module):
    def __init__(self, topk: int, activation: str):
        super().__init__()
        self.language_model = LanguageModel(topk, activation)


def main(out: str, topk: int, activation: str) -> None:
    import deepspeed

    init_deepspeed_comm()
    torch.manual_seed(0)
    model = GPTModel(topk, activation)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config={"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.save_checkpoint(out, tag="global_step1")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
