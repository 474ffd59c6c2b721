"""Per-rank job of the SIMoE tensor-parallel test (run through `ep_harness.spawn`).

Every rank builds the same SIMoE GPT (the CPU initialisation draws full tensors from the shared
seed, then each rank keeps its slice), trains it for a few steps in training mode (sampled
hard-concrete noise, the mask regulariser, the Lagrangian's dual step) and returns the losses and
its trainable parameters gathered to their full, unsplit shape.
"""
from __future__ import annotations

import torch

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3


def gathered(param: torch.Tensor, group) -> torch.Tensor:
    """The whole parameter: tensor-parallel slices concatenated along their partition dim."""
    if not getattr(param, "tensor_model_parallel", False) or group.size() == 1:
        return param.detach().clone()
    parts = [torch.empty_like(param) for _ in range(group.size())]
    torch.distributed.all_gather(parts, param.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def eval_losses(model, seed: int = 7) -> torch.Tensor:
    """Per-token losses [B, S] on a fixed batch, in inference mode (deterministic masks)."""
    from megamoe.megatron.models import causal_attention_mask

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    prompt_mask = torch.arange(SEQ).expand(BATCH, -1) < SEQ // 2
    model.eval()
    with torch.no_grad():
        return model(tokens[:, :-1], torch.arange(SEQ).expand(BATCH, -1),
                     causal_attention_mask(SEQ), labels=tokens[:, 1:], prompt_mask=prompt_mask)


def simoe_tp_job(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """Train; at TP=2 save a torch_dist checkpoint, at TP=1 also load it into a fresh model."""
    from megatron.core import dist_checkpointing, parallel_state

    from megamoe.checkpointing.safe_dcp import load_dist_checkpoint

    from megamoe.megatron.models import causal_attention_mask, tiny_transformer_config
    from megamoe.megatron.runtime import setup_megatron
    from megamoe.simoe.config import SIMoEConfig
    from megamoe.simoe.model import SIMoEGPTModel
    from megamoe.simoe.penalties import MaskRegularizer

    setup_megatron(tensor_model_parallel_size=world_size, seed=5)
    config = tiny_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4,
                                     ffn_hidden_size=64, normalization="RMSNorm",
                                     tensor_model_parallel_size=world_size)
    simoe = SIMoEConfig(num_experts=4, lagrangian_lr=1.0, orthogonality_coefficient=1.0)
    def build():
        return SIMoEGPTModel(config, simoe, vocab_size=VOCAB, max_sequence_length=SEQ,
                             share_embeddings_and_output_weights=False)

    model = build()
    regularizer = MaskRegularizer(model, simoe)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=3e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        prompt_mask = torch.rand(BATCH, SEQ, generator=gen) < 0.5
        positions = torch.arange(SEQ).expand(BATCH, -1)
        lm = model(tokens[:, :-1], positions, causal_attention_mask(SEQ),
                   labels=tokens[:, 1:], prompt_mask=prompt_mask).mean()
        penalty, density = regularizer()
        loss = lm + penalty
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        regularizer.lagrangian.step(density)
        losses.append(torch.stack([lm.detach(), penalty.detach()]))
    group = parallel_state.get_tensor_model_parallel_group()
    result = {"eval": eval_losses(model)}
    if world_size == 2:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        fresh = build()
        fresh.load_state_dict(load_dist_checkpoint(fresh.sharded_state_dict(), ckpt_dir))
        result["loaded_eval"] = eval_losses(fresh)
    return {**result, "losses": torch.stack(losses), "density": density.detach(),
            "multipliers": regularizer.lagrangian.multipliers.clone(),
            "params": {name: gathered(p, group) for name, p in model.named_parameters()
                       if p.requires_grad}}
