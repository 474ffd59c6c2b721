"""Held-out loss: the mean token loss of fixed batches of the valid split, in eval mode.

The batches are the first `evaluation.batches` global batches of the valid split of
`data.split` (the same every time, dealt to data-parallel ranks like training batches). The
model runs in eval mode without gradients, so routers route as at inference (frozen expert
thresholds, plain top-k for Sinkhorn, greedy top-1 for BASE) and nothing is counted for
balancing. The loss is summed over data-parallel ranks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megamoe.errors import ConfigError
from megamoe.megatron.masks import attention_mask_for
from megamoe.train.config import TrainConfig
from megamoe.train.data import build_gpt_datasets, iterate_batches
from megamoe.train.inputs import data_sources
from megamoe.train.tokenizer import SentencePieceTokenizer


class HeldOutLoss:
    """`evaluation.batches` fixed valid-split batches; call with the model for their loss."""

    def __init__(self, config: TrainConfig, device: torch.device):
        e, t = config.evaluation, config.training
        prefixes, tokenizer_model = data_sources(config)
        tokenizer = SentencePieceTokenizer(tokenizer_model)
        _, valid, _ = build_gpt_datasets(
            prefixes, tokenizer, seq_length=config.model.seq_length, seed=t.seed,
            num_samples=(0, e.batches * t.global_batch_size, None),
            index_cache_dir=Path(config.data.cache_dir).expanduser() / "index",
            split=config.data.split, weights=config.data.weights,
            eod_mask_loss=config.data.eod_mask_loss)
        if valid is None or len(valid) == 0:
            raise ConfigError(
                f"evaluation.interval={e.interval} needs a valid split, but data.split="
                f"{config.data.split!r} holds out no documents; set e.g. data.split=95,5,0")
        dp_size = parallel_state.get_data_parallel_world_size()
        batches = iterate_batches(valid, micro_batch_size=t.micro_batch_size,
                                  dp_rank=parallel_state.get_data_parallel_rank(),
                                  dp_size=dp_size)
        per_rank = e.batches * t.global_batch_size // (t.micro_batch_size * dp_size)
        self.batches = [b for _, b in zip(range(per_rank), batches)]
        self.interval, self.last_step = e.interval, t.train_steps
        self.mask = attention_mask_for(config.model.seq_length, device.type == "cuda")
        self.device = device

    @classmethod
    def for_run(cls, config: TrainConfig, device: torch.device) -> Optional["HeldOutLoss"]:
        """The evaluator of a run, or None when `evaluation.interval` is 0."""
        return cls(config, device) if config.evaluation.interval > 0 else None

    def due(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.last_step

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float:
        """Mean token loss over the held-out batches of every data-parallel rank."""
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, device=self.device)
        try:
            for batch in self.batches:
                batch = [t.to(self.device) for t in batch]
                tokens, labels, loss_mask, position_ids = batch
                losses_BS = model(tokens, position_ids, self.mask, labels=labels)
                totals += torch.stack([(losses_BS.float() * loss_mask).sum(), loss_mask.sum()])
        finally:
            model.train(was_training)
        if dist.is_initialized():
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        return float(totals[0] / totals[1].clamp_min(1.0))
