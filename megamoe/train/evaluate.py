"""Held-out loss: the mean token loss of fixed batches of the valid split, in eval mode.

The batches are the first `evaluation.batches` global batches of the valid split of
`data.split` (the same every time, dealt to data-parallel ranks like training batches). The
model runs in eval mode without gradients, so routers route as at inference (frozen expert
thresholds, plain top-k for Sinkhorn, greedy top-1 for BASE) and nothing is counted for
balancing. The loss is summed over data-parallel ranks. Beside it, each MoE layer's routing at
inference (`routing_metrics`): experts per token, and how a token's loss goes with its number of
experts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megamoe.balancing.inference import InferenceTally, tallying_inference_routing
from megamoe.errors import ConfigError
from megamoe.megatron.masks import attention_mask_for
from megamoe.train.config import TrainConfig
from megamoe.train.data import build_gpt_datasets, iterate_batches
from megamoe.train.tokenizer import Tokenizer


class HeldOutLoss:
    """`evaluation.batches` fixed valid-split batches; call with the model for their loss."""

    def __init__(self, config: TrainConfig, device: torch.device, prefixes: list[str],
                 tokenizer: Tokenizer):
        e, t = config.evaluation, config.training
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
    def for_run(cls, config: TrainConfig, device: torch.device, prefixes: list[str],
                tokenizer: Tokenizer) -> Optional["HeldOutLoss"]:
        """The evaluator of a run on its data `prefixes` (of `tokenizer`, as
        `inputs.data_sources` gives them), or None when `evaluation.interval` is 0."""
        return cls(config, device, prefixes, tokenizer) if config.evaluation.interval > 0 \
            else None

    def due(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.last_step

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, object]:
        """`heldout_loss`, the mean token loss over the held-out batches of every data-parallel
        rank, and the MoE layers' routing at inference (`routing_metrics`)."""
        was_training = model.training
        model.eval()
        losses, masks = [], []
        try:
            with tallying_inference_routing(model) as tallies:
                for batch in self.batches:
                    tokens, labels, loss_mask, position_ids = [t.to(self.device) for t in batch]
                    losses.append(model(tokens, position_ids, self.mask, labels=labels).float())
                    masks.append(loss_mask.float())
        finally:
            model.train(was_training)
        losses_NBS, masks_NBS = torch.stack(losses), torch.stack(masks)
        totals = torch.stack([(losses_NBS * masks_NBS).sum(), masks_NBS.sum()])
        if dist.is_initialized():
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        return {"heldout_loss": float(totals[0] / totals[1].clamp_min(1.0)),
                **routing_metrics(tallies, losses_NBS, masks_NBS)}


def routing_metrics(tallies: dict[int, InferenceTally], losses_NBS: torch.Tensor,
                    masks_NBS: torch.Tensor) -> dict[str, object]:
    """Per MoE layer n, from the eval-mode forwards of the held-out batches:
    `heldout/layer{n}/experts_per_token` (mean over the tokens the layer routed), and where the
    layer saw whole sequences (no sequence parallelism), per token paired with its loss:
    `.../tokens_by_experts` (fraction of tokens with k = 0..E experts), `.../loss_by_experts`
    (their mean loss, None for no tokens) and `.../loss_experts_corr` (Pearson correlation of
    a token's loss with its number of experts; None when either is constant)."""
    metrics: dict[str, object] = {}
    for layer, tally in sorted(tallies.items()):
        if not tally.counts_BS:
            continue
        counts_NBS = torch.stack(tally.counts_BS)
        whole = counts_NBS.shape == losses_NBS.shape
        sums = torch.stack([counts_NBS.sum(), counts_NBS.new_tensor(counts_NBS.numel())]).double()
        if whole:
            sums = torch.cat([sums, _paired_sums(counts_NBS, losses_NBS, masks_NBS,
                                                 tally.num_experts)])
        if dist.is_initialized():  # tokens split over data- (and sequence-) parallel ranks
            dist.all_reduce(sums, group=parallel_state.get_tensor_and_data_parallel_group())
        name = f"heldout/layer{layer}"
        metrics[f"{name}/experts_per_token"] = float(sums[0] / sums[1].clamp_min(1.0))
        if whole:
            metrics.update({f"{name}/{key}": value for key, value in
                            _paired_metrics(sums[2:], tally.num_experts).items()})
    return metrics


def _paired_sums(counts_NBS: torch.Tensor, losses_NBS: torch.Tensor, masks_NBS: torch.Tensor,
                 num_experts: int) -> torch.Tensor:
    """Loss sums and token counts per number of experts k = 0..E, then n, sum x, sum y,
    sum xy, sum x^2, sum y^2 (x experts, y loss) over the loss-masked tokens, in float64."""
    keep = masks_NBS > 0
    x, y = counts_NBS[keep].double(), losses_NBS[keep].double()
    k = x.long().clamp(0, num_experts)
    loss_sums = y.new_zeros(num_experts + 1).index_add_(0, k, y)
    tokens = torch.bincount(k, minlength=num_experts + 1).double()
    moments = torch.stack([x.new_tensor(x.numel()), x.sum(), y.sum(), (x * y).sum(),
                           (x * x).sum(), (y * y).sum()])
    return torch.cat([loss_sums, tokens, moments])


def _paired_metrics(sums: torch.Tensor, num_experts: int) -> dict[str, object]:
    """The per-layer metrics of `routing_metrics` from `_paired_sums` (reduced)."""
    loss_sums, tokens = sums[:num_experts + 1], sums[num_experts + 1:2 * num_experts + 2]
    n, sx, sy, sxy, sxx, syy = sums[2 * num_experts + 2:].tolist()
    total = max(float(tokens.sum()), 1.0)
    covariance = n * sxy - sx * sy
    spread = (n * sxx - sx * sx) * (n * syy - sy * sy)
    return {"tokens_by_experts": [float(t) / total for t in tokens],
            "loss_by_experts": [float(s / t) if t > 0 else None
                                for s, t in zip(loss_sums, tokens)],
            "loss_experts_corr": covariance / spread ** 0.5 if spread > 1e-12 else None}
