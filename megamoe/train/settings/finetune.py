"""The `finetune` section: instruction tuning instead of pretraining."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megamoe.settings import check_fields
from megamoe.train.methods import training_method


@dataclass
class FinetuneConfig:
    """Instruction tuning (megamoe.instruct.finetune) instead of pretraining."""

    method: str = "none"
    """`none` (pretraining on `data`), or a method of `megamoe.train.methods`; those of
    megamoe are instruction tuning: `full` (every weight of the model,
    dense or MoE, e.g. a sparse-upcycled one), `lora` (low-rank factors on every linear of a
    dense model) or `simoe` (sparse interpolated experts, arXiv 2506.12597). Start from a
    dense or upcycled checkpoint with `checkpoint.init_from`. The method checks the rest of the
    config it trains with."""
    train_data: Optional[str] = None
    """jsonl of {prompt, response} or {messages} records (megamoe.instruct.dataset); None: the
    generated multi-domain set's seen task families (built once under `data.cache_dir`)."""
    eval_data: list[str] = field(default_factory=list)
    """jsonl files scored by exact match; empty: the generated set's held-out examples of the
    seen families and its unseen families."""
    eval_interval: int = 0
    """Exact match every this many steps (metrics `eval/{file}/{task}`); 0: at the end only."""
    max_new_tokens: int = 24
    """Longest generated answer at evaluation."""
    lora_rank: int = 8
    """`lora`: rank r of every low-rank update."""
    lora_alpha: float = 16.0
    """`lora`: the update is scaled by lora_alpha / lora_rank."""
    simoe: dict = field(default_factory=dict)
    """`simoe`: megamoe.simoe.SIMoEConfig fields (num_experts, target_sparsity, ...)."""

    def __post_init__(self) -> None:
        check_fields(self, "finetune")
        training_method(self.method)  # an unknown method is a ConfigError naming the known ones
