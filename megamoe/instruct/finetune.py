"""Instruction tuning inside the training loop: the method's model, its data and its evaluation,
as `megamoe.train.methods.TrainingMethod`s (the `megamoe.training_methods` entry points).

`finetune.method` (full | lora | simoe) turns `python -m megamoe.train` from pretraining into
instruction tuning of a checkpoint given by `checkpoint.init_from`:
- the model: the configured GPT (`full`: every weight trains; a sparse-upcycled MoE checkpoint
  is fine-tuned this way), LoRA on every linear of a dense GPT (arXiv 2106.09685), or SIMoE
  (arXiv 2506.12597); the seed's weights load under their usual names, the method's own
  parameters start from their initialisation;
- the data: jsonl instruction records, one padded sequence each, the loss on responses only,
  dealt to data-parallel ranks in a seeded order that starts anew every epoch (resumable at any
  consumed-sample count);
- evaluation: exact match by greedy generation on each `eval_data` file, per task family.
Without `finetune.train_data`, the generated multi-domain set (megamoe.instruct.tasks) is written
once under `data.cache_dir` and used: its seen families train, its held-out examples and unseen
families evaluate.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig
from torch.utils.data import Dataset

from megamoe.errors import ConfigError
from megamoe.instruct import tasks
from megamoe.instruct.dataset import InstructionDataset, collate, read_records
from megamoe.instruct.evaluate import exact_match
from megamoe.instruct.lora import TRAINABLE_SUFFIXES as LORA_SUFFIXES
from megamoe.instruct.lora import lora_gpt
from megamoe.megatron.masks import attention_mask_for
from megamoe.simoe.config import SIMoEConfig
from megamoe.simoe.model import SIMoEGPTModel, is_simoe_state
from megamoe.train.config import TrainConfig, coerce_fields
from megamoe.train.data import iterate_batches
from megamoe.train.model import build_model, padded_vocab_size

GENERATED_SET_VERSION = 1


class FullFinetuning:
    """`full`: every weight of the configured GPT (dense or MoE, e.g. sparse-upcycled) trains."""

    routes_prompt = False

    def check(self, config: TrainConfig) -> None:
        f = config.finetune
        _require(config.parallel.pipeline == 1,
                 f"finetune.method={f.method} runs with parallel.pipeline=1 (exact-match "
                 "evaluation generates on one stage); got parallel.pipeline="
                 f"{config.parallel.pipeline}")
        _require(f.eval_interval >= 0, f"finetune.eval_interval={f.eval_interval} must be >= 0")
        _require(f.max_new_tokens >= 1,
                 f"finetune.max_new_tokens={f.max_new_tokens} must be >= 1")

    def build_model(self, config: TrainConfig, tc: TransformerConfig, vocab_size: int
                    ) -> list[torch.nn.Module]:
        return build_model(config, tc, vocab_size)

    def batches(self, config: TrainConfig, tokenizer, dp_rank: int, dp_size: int):
        return InstructionBatches(config, data_paths(config)[0], tokenizer, dp_rank, dp_size)

    def evaluation(self, config: TrainConfig, tokenizer, device) -> "ExactMatchEvaluation":
        return ExactMatchEvaluation(config, data_paths(config)[1], tokenizer, device)

    def is_own_state(self, key: str) -> bool:
        return False

    def after_step(self, model: torch.nn.Module) -> dict[str, float]:
        return {}


class _DenseAdapter(FullFinetuning):
    """A method that adapts a dense GPT with parameters of its own."""

    def check(self, config: TrainConfig) -> None:
        super().check(config)
        f = config.finetune
        _require(config.model.first_k_dense == config.model.num_layers,
                 f"finetune.method={f.method} adapts a dense model: set model.first_k_dense="
                 f"{config.model.num_layers} (model.num_layers)")
        _require(config.parallel.tensor == 1,
                 f"finetune.method={f.method} trains at parallel.tensor=1: with tensor "
                 "parallelism the trainer turns on sequence parallelism, which it does not "
                 f"support yet; got parallel.tensor={config.parallel.tensor}")


def _gpt_settings(config: TrainConfig, vocab_size: int) -> dict:
    return dict(vocab_size=padded_vocab_size(vocab_size, config),
                max_sequence_length=config.model.seq_length,
                share_embeddings_and_output_weights=config.model.share_embeddings,
                position_embedding_type=config.model.position_embedding,
                rotary_base=config.model.rotary_base)


class LoRAFinetuning(_DenseAdapter):
    """`lora`: low-rank factors on every linear of a dense GPT (arXiv 2106.09685)."""

    def check(self, config: TrainConfig) -> None:
        super().check(config)
        rank = config.finetune.lora_rank
        _require(rank >= 1, f"finetune.lora_rank={rank} must be >= 1")

    def build_model(self, config: TrainConfig, tc: TransformerConfig, vocab_size: int
                    ) -> list[torch.nn.Module]:
        f = config.finetune
        return [lora_gpt(tc, f.lora_rank, f.lora_alpha, **_gpt_settings(config, vocab_size))]

    def is_own_state(self, key: str) -> bool:
        return key.endswith(LORA_SUFFIXES)


def _simoe_config(config: TrainConfig) -> SIMoEConfig:
    """`finetune.simoe` as a SIMoEConfig: known field names, values of the fields' types."""
    settings = config.finetune.simoe
    known = {field.name for field in dataclasses.fields(SIMoEConfig)}
    unknown = sorted(set(settings) - known)
    _require(not unknown, f"finetune.simoe has unknown keys {unknown}; known: {sorted(known)}")
    return SIMoEConfig(**coerce_fields(SIMoEConfig, settings, "finetune.simoe"))


class SIMoEFinetuning(_DenseAdapter):
    """`simoe`: sparse interpolated experts (arXiv 2506.12597) over a dense GPT."""

    routes_prompt = True

    def check(self, config: TrainConfig) -> None:
        super().check(config)
        _simoe_config(config)

    def build_model(self, config: TrainConfig, tc: TransformerConfig, vocab_size: int
                    ) -> list[torch.nn.Module]:
        simoe = _simoe_config(config)
        anneal_steps = simoe.router_anneal_steps or config.training.train_steps
        return [SIMoEGPTModel(tc, dataclasses.replace(simoe, router_anneal_steps=anneal_steps),
                              **_gpt_settings(config, vocab_size))]

    def is_own_state(self, key: str) -> bool:
        return is_simoe_state(key)

    def after_step(self, model: torch.nn.Module) -> dict[str, float]:
        """SIMoE's dual step on its sparsity Lagrangian and its router's temperature; metrics."""
        return model.after_step()


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def data_paths(config: TrainConfig) -> tuple[Path, list[Path]]:
    """(training jsonl, evaluation jsonl files); the generated set is written by rank 0 once."""
    f = config.finetune
    if f.train_data is not None:
        return Path(f.train_data).expanduser(), [Path(p).expanduser() for p in f.eval_data]
    directory = Path(config.data.cache_dir).expanduser() / \
        f"instructions-v{GENERATED_SET_VERSION}-seed{config.training.seed}"
    if dist.get_rank() == 0 and not (directory / "eval_unseen.jsonl").exists():
        tasks.write_instruction_set(directory, seed=config.training.seed)
    dist.barrier()
    evals = [Path(p).expanduser() for p in f.eval_data] or \
        [directory / "eval_seen.jsonl", directory / "eval_unseen.jsonl"]
    return directory / "train.jsonl", evals


class _Epochs(Dataset):
    """`length` samples cycling over `base` in a fresh seeded order each epoch."""

    def __init__(self, base: Dataset, length: int, seed: int) -> None:
        self.base, self.length, self.seed = base, length, seed
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        epoch, position = divmod(index, len(self.base))
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._orders[epoch] = torch.randperm(len(self.base), generator=gen).tolist()
        return self.base[self._orders[epoch][position]]


class InstructionBatches:
    """The tuning set, tokenized and checked once (before the run writes anything), dealt as
    this data-parallel rank's micro-batches from any global sample on."""

    def __init__(self, config: TrainConfig, train_path: Path, tokenizer, dp_rank: int,
                 dp_size: int) -> None:
        t = config.training
        dataset = InstructionDataset(train_path, tokenizer, config.model.seq_length)
        steps = t.train_steps + config.guards.max_rollbacks
        self.samples = _Epochs(dataset, steps * t.global_batch_size, t.seed)
        self.config, self.dp_rank, self.dp_size = config, dp_rank, dp_size

    def __call__(self, start_sample: int) -> Iterator:
        t = self.config.training
        return iterate_batches(self.samples, micro_batch_size=t.micro_batch_size,
                               dp_rank=self.dp_rank, dp_size=self.dp_size,
                               start_sample=start_sample,
                               num_workers=self.config.data.num_workers, collate=collate)


class ExactMatchEvaluation:
    """Exact match on every evaluation file, every `eval_interval` steps and at the end."""

    def __init__(self, config: TrainConfig, paths: list[Path], tokenizer, device) -> None:
        self.config, self.tokenizer, self.device = config, tokenizer, device
        self.sets = {path.stem: read_records(path) for path in paths}

    def due(self, step: int) -> bool:
        interval = self.config.finetune.eval_interval
        return step == self.config.training.train_steps or (interval > 0 and step % interval == 0)

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        mask = attention_mask_for(self.config.model.seq_length, self.device.type == "cuda")

        def forward(tokens_BS, prompt_mask_BS):
            tokens_BS, prompt_mask_BS = tokens_BS.to(self.device), prompt_mask_BS.to(self.device)
            length = tokens_BS.shape[1]
            positions = torch.arange(length, device=self.device).expand_as(tokens_BS)
            extra = {"prompt_mask": prompt_mask_BS} if isinstance(model, SIMoEGPTModel) else {}
            return model(tokens_BS, positions,
                         None if mask is None else mask[..., :length, :length],
                         runtime_gather_output=True, **extra).float().cpu()

        was_training = model.training
        model.eval()
        try:
            metrics = {}
            for name, records in self.sets.items():
                scores = exact_match(forward, self.tokenizer, records,
                                     self.config.finetune.max_new_tokens,
                                     self.config.model.seq_length)
                metrics.update({f"eval/{name}/{task}": value for task, value in scores.items()})
            return metrics
        finally:
            model.train(was_training)
