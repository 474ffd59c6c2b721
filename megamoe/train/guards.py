"""Divergence guards: a step whose loss or gradient norm is not finite, or whose loss spikes, is
stopped before the optimizer update.

Every rank decides from the same numbers: the loss summed over ranks and a "this rank saw a
non-finite value" flag, reduced in the step's one all-reduce (megamoe.train.loop), so no rank
applies an update that another rank refused.

- Non-finite loss or gradient norm (`guards.nonfinite`, as Megatron-LM's
  --check-for-nan-in-loss-and-grad): the run stops with `DivergenceError`, without saving. The
  message names the step and, per rank, the first parameter holding a non-finite value, the first
  module (in forward order) whose output went non-finite and the first gradient (in backward
  order) that did. Module outputs are watched by `NonFiniteTracer`: one forward hook per module
  folds `isfinite(output.sum())` into a flag on the output's device, with no host
  synchronisation; the flags are only read when the guard trips. Cost per step: one reduction
  per module output.
- Loss spike (`guards.spike_factor`, `guards.spike_window`): a loss above factor x the mean of
  the last `window` accepted losses. `stop` raises `DivergenceError`; `rollback` reloads the
  latest checkpoint and skips the spiking step's batch (PaLM, arXiv 2204.02311 sec. 5.1,
  restarted before spikes and skipped the batches that caused them), at most `max_rollbacks`
  times.
"""
from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megamoe.errors import ConfigError
from megamoe.train.config import GuardsConfig

EXIT_DIVERGED = 3
"""Exit code of a run a divergence guard stopped (2 is bad input)."""

_LAYER = re.compile(r"decoder\.layers\.(\d+)\b")


class DivergenceError(RuntimeError):
    """Training diverged (non-finite values or a loss spike); nothing was saved."""


def describe_module(name: str) -> str:
    """`decoder.layers.2.mlp` -> `decoder.layers.2.mlp (layer 3)`: layers numbered from 1, as
    Megatron's layer_number and the moe/layer{n} metrics."""
    match = _LAYER.search(name)
    return f"{name} (layer {int(match.group(1)) + 1})" if match else name


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def _passes_through(module: torch.nn.Module) -> bool:
    """Containers, dropout and Megatron's identity placeholders: their outputs are their inputs'
    (or none), so watching them costs without telling anything."""
    return isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Dropout)) or \
        type(module).__name__.startswith("Identity")


class NonFiniteTracer:
    """Forward hooks recording, per module, whether any output of this step was non-finite."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [(name, module) for name, module in model.named_modules()
                        if name and not _passes_through(module)]
        self.flags: list[Optional[torch.Tensor]] = [None] * len(self.modules)
        self.order: list[int] = []  # module indices in the order their hooks first fired
        self.handles = [module.register_forward_hook(self._hook(i))
                        for i, (_, module) in enumerate(self.modules)]

    def _hook(self, index: int):
        def record(module, inputs, output) -> None:
            tensors = _tensors(output)
            if not tensors:
                return
            bad = ~torch.isfinite(torch.stack([t.detach().sum(dtype=torch.float32)
                                               for t in tensors])).all()
            flag = self.flags[index]
            if flag is None:
                self.order.append(index)
                self.flags[index] = bad
            else:
                self.flags[index] = flag | bad
        return record

    def reset(self) -> None:
        """Start a new step: forget the flags (the forward order is kept)."""
        self.flags = [None if flag is None else torch.zeros_like(flag) for flag in self.flags]

    def first_nonfinite(self) -> Optional[str]:
        """The module, in forward order, whose output went non-finite first this step."""
        for index in self.order:
            if bool(self.flags[index]):
                return self.modules[index][0]
        return None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient the optimizer uses: Megatron DDP's `main_grad` on GPU, else `.grad`."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def first_nonfinite_parameter(model: torch.nn.Module) -> Optional[str]:
    """The name of this rank's first parameter holding NaN or Inf, or None."""
    return next((name for name, p in model.named_parameters()
                 if not torch.isfinite(p.detach()).all()), None)


def diagnose(model: torch.nn.Module, tracer: Optional[NonFiniteTracer]) -> str:
    """This rank's account of where non-finite values are (run only when the guard trips)."""
    named = list(model.named_parameters())
    parts = []
    weight = first_nonfinite_parameter(model)
    if weight is not None:
        parts.append(f"parameter {describe_module(weight)} holds NaN/Inf")
    output = tracer.first_nonfinite() if tracer is not None else None
    if output is not None:
        parts.append(f"first non-finite output: {describe_module(output)}")
    grad = next((n for n, p in reversed(named)
                 if _grad(p) is not None and not torch.isfinite(_grad(p)).all()), None)
    if grad is not None:
        parts.append(f"first non-finite gradient (backward order): {describe_module(grad)}")
    return "; ".join(parts) or "no non-finite weight, output or gradient on this rank"


def gather_diagnoses(text: str) -> str:
    """Every rank's diagnosis in one line (a collective: all ranks call it together)."""
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    if len(set(texts)) == 1:
        return texts[0]
    return " | ".join(f"rank {rank}: {t}" for rank, t in enumerate(texts))


@dataclass
class Spike:
    """A loss above `factor` x `average`."""

    loss: float
    average: float
    factor: float

    def __str__(self) -> str:
        return (f"loss {self.loss:.4f} is {self.loss / self.average:.1f}x the mean "
                f"{self.average:.4f} of the last steps (guards.spike_factor={self.factor})")


class LossSpikeGuard:
    """A moving window of accepted (step, loss) pairs; `check` finds spikes once it is full."""

    def __init__(self, config: GuardsConfig) -> None:
        self.factor = config.spike_factor
        self.window: deque[tuple[int, float]] = deque(maxlen=config.spike_window)

    def check(self, loss: float) -> Optional[Spike]:
        if self.factor <= 0 or len(self.window) < self.window.maxlen:
            return None
        average = sum(value for _, value in self.window) / len(self.window)
        return Spike(loss, average, self.factor) if loss > self.factor * average else None

    def accept(self, step: int, loss: float) -> None:
        self.window.append((step, loss))

    def rewind(self, step: int) -> None:
        """Forget the losses after `step` (the run rolled back to it; they will be replayed)."""
        while self.window and self.window[-1][0] > step:
            self.window.pop()


def nonfinite(*values: float) -> bool:
    return not all(math.isfinite(v) for v in values)


def poison_parameter(model: torch.nn.Module, prefix: str) -> str:
    """Fault tests (`megamoe.train.faults`): set element 0 of the first parameter whose name
    starts with `prefix` to NaN; returns the parameter's name."""
    for name, param in model.named_parameters():
        if name.startswith(prefix):
            with torch.no_grad():
                param.view(-1)[0] = float("nan")
            return name
    names = sorted({re.sub(r"\.\d+\.", ".N.", n) for n, _ in model.named_parameters()})
    raise ConfigError(f"nan_param={prefix!r} (MEGAMOE_TEST_FAULTS) matches no parameter; "
                      f"names look like {', '.join(names[:6])}, ...")


def poison_batch(batch):
    """Fault tests (`megamoe.train.faults`): the batch with every label set to token 0 (the
    tokenizer's unknown piece, which the data never asks for), so its loss jumps once the model
    has learnt the data's token statistics."""
    return batch._replace(labels=torch.zeros_like(batch.labels))
