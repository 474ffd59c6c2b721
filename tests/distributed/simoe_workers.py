"""Per-rank job of the SIMoE / LoRA tensor-parallel test (run through `megamoe.parallel.spawn`).

Every rank builds the same model (the CPU initialisation draws full tensors from the shared seed,
then each rank keeps its slice), trains it for a few steps in training mode (for SIMoE: sampled
hard-concrete noise, the mask regulariser, the Lagrangian's dual step) and returns the losses and
its trainable parameters gathered to their full, unsplit shape.
"""
from __future__ import annotations

from typing import Callable

import torch

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3


def gathered(param: torch.Tensor, group) -> torch.Tensor:
    """The whole parameter: tensor-parallel slices concatenated along their partition dim."""
    if not getattr(param, "tensor_model_parallel", False) or group.size() == 1:
        return param.detach().clone()
    parts = [torch.empty_like(param) for _ in range(group.size())]
    torch.distributed.all_gather(parts, param.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def trainable_params(model, group) -> dict:
    return {name: gathered(p, group) for name, p in model.named_parameters() if p.requires_grad}


def lm_losses(model, tokens, prompt_mask) -> torch.Tensor:
    """Per-token losses [B, S]; `prompt_mask` None for a model without a router."""
    from megamoe.megatron.masks import causal_attention_mask

    extra = {} if prompt_mask is None else {"prompt_mask": prompt_mask}
    return model(tokens[:, :-1], torch.arange(SEQ).expand(BATCH, -1), causal_attention_mask(SEQ),
                 labels=tokens[:, 1:], **extra)


def train(model, routed: bool, after_step: Callable[[], object] = lambda: None) -> torch.Tensor:
    """STEPS Adam steps on the LM loss (and what the model adds to it), each followed by
    `after_step()`; returns the LM losses [STEPS]."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        prompt_mask = torch.rand(BATCH, SEQ, generator=gen) < 0.5
        lm = lm_losses(model, tokens, prompt_mask if routed else None).mean()
        optimizer.zero_grad()
        lm.backward()
        optimizer.step()
        after_step()
        losses.append(lm.detach())
    return torch.stack(losses)


def eval_losses(model) -> torch.Tensor:
    """Per-token losses [B, S] on a fixed batch, in inference mode (deterministic masks)."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        return lm_losses(model, tokens, torch.arange(SEQ).expand(BATCH, -1) < SEQ // 2)


def simoe_tp_job(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """Train SIMoE and LoRA; at TP=2 save SIMoE's torch_dist checkpoint, at TP=1 also load it
    into a fresh model."""
    from megatron.core import dist_checkpointing, parallel_state

    from megamoe.checkpointing.safe_dcp import load_dist_checkpoint
    from megamoe.instruct.lora import lora_gpt
    from tiny_models import tiny_transformer_config
    from megamoe.megatron.runtime import setup_megatron
    from megamoe.simoe.config import SIMoEConfig
    from megamoe.simoe.model import SIMoEGPTModel

    setup_megatron(tensor_model_parallel_size=world_size, seed=5)
    config = tiny_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4,
                                     ffn_hidden_size=64, normalization="RMSNorm",
                                     tensor_model_parallel_size=world_size)
    simoe = SIMoEConfig(num_experts=4, lagrangian_lr=1.0, orthogonality_coefficient=1.0,
                        mask_lr_scale=1.0)  # Adam at lr 3e-2: keep the masks above target

    def build():
        return SIMoEGPTModel(config, simoe, vocab_size=VOCAB, max_sequence_length=SEQ,
                             share_embeddings_and_output_weights=False)

    model = build()  # its mask regulariser joins the loss in training mode
    regularizer = model.simoe_regularizer
    losses = train(model, routed=True, after_step=regularizer.step)
    group = parallel_state.get_tensor_model_parallel_group()
    result = {"eval": eval_losses(model), "losses": losses,
              "density": regularizer()[1].detach(),
              "multipliers": regularizer.lagrangian.multipliers.clone(),
              "params": trainable_params(model, group)}
    if world_size == 2:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        fresh = build()
        fresh.load_state_dict(load_dist_checkpoint(fresh.sharded_state_dict(), ckpt_dir))
        result["loaded_eval"] = eval_losses(fresh)
    torch.manual_seed(11)  # the TP=1 run drew more numbers above (the fresh model)
    lora = lora_gpt(config, rank=2, alpha=4.0, vocab_size=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=False)
    result["lora_losses"] = train(lora, routed=False)
    result["lora_params"] = trainable_params(lora, group)
    return result
