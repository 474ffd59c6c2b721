"""What the training loop trains besides pretraining: methods that applications add.

`finetune.method` names a method; `none` is pretraining on `data`, which the loop does itself.
Every other name is a `megamoe.training_methods` entry point (pyproject.toml): instruction tuning
(`full`, `lora`, `simoe`) lives in `megamoe.instruct.finetune`, on top of the trainer, so the
trainer never imports an application, and a new method is one class plus one entry-point line.
"""
from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Callable, Iterator, Optional, Protocol

import torch

from megamoe.errors import ConfigError

GROUP = "megamoe.training_methods"
PRETRAINING = "none"


class Evaluation(Protocol):
    def due(self, step: int) -> bool:
        """Whether to evaluate after optimizer step `step`."""

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """Metrics of `model`."""


class TrainingMethod(Protocol):
    """A method's model, data and evaluation, as the loop asks for them (config: TrainConfig)."""

    routes_prompt: bool
    """The model's forward takes the batch's `prompt_mask` (SIMoE's router reads the prompt)."""

    def check(self, config) -> None:
        """Raise ConfigError for settings the method cannot train with."""

    def build_model(self, config, tc, vocab_size: int) -> list[torch.nn.Module]:
        """This rank's model chunks, like `megamoe.train.model.build_model`."""

    def batches(self, config, tokenizer, dp_rank: int, dp_size: int
                ) -> Callable[[int], Iterator]:
        """This data-parallel rank's micro-batches from a global sample count on."""

    def evaluation(self, config, tokenizer, device: torch.device) -> Optional[Evaluation]:
        """The method's evaluation, or None."""

    def is_own_state(self, key: str) -> bool:
        """Whether a model key is the method's own (absent from the `init_from` checkpoint)."""

    def after_step(self, model: torch.nn.Module) -> dict[str, float]:
        """What the method does once per optimizer step; its metrics."""


@functools.cache
def _entry_points() -> dict:
    return {point.name: point for point in entry_points(group=GROUP)}


def method_names() -> list[str]:
    """`none` and every installed method."""
    return [PRETRAINING, *sorted(_entry_points())]


def training_method(name: str) -> Optional[TrainingMethod]:
    """The method `finetune.method` names, or None for pretraining."""
    if name == PRETRAINING:
        return None
    point = _entry_points().get(name)
    if point is None:
        raise ConfigError(f"finetune.method={name!r} is not one of {method_names()}; a method "
                          f"comes from the '{GROUP}' entry points of an installed package "
                          "(reinstall megamoe with `pip install -e .` if it is missing)")
    return point.load()()
