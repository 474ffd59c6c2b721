"""What a converter reads, held to the model it declares: every tensor a floating-point tensor of
its own, of the shape the model needs. One check for every converter (Hugging Face dense and MoE,
Megatron-DeepSpeed), so each refuses the same inputs with the same one line before it writes.

A model's expected shapes are a mapping from tensor name to shape, where `None` in a dimension
accepts any size (a size the declared model does not fix, such as the position-embedding rows).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from megamoe.checkpointing.torch_files import require_finite
from megamoe.errors import CheckpointError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The weight dtypes megamoe converts (safetensors' F32, BF16, F16)."""

Shape = tuple[Optional[int], ...]


def shape_matches(shape: tuple[int, ...], want: Shape) -> bool:
    """`shape` has `want`'s dimensions, each equal where `want` fixes it."""
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def _shown(want: Shape) -> str:
    return "[" + ", ".join("any" if w is None else str(w) for w in want) + "]"


def check_shapes(found: Mapping[str, tuple[int, ...]], expected: Mapping[str, Shape],
                 where: str, model: str, complete: bool = True) -> None:
    """Refuse in one line, naming the first tensor (by name): with `complete`, a tensor
    `expected` names that `found` lacks and one `found` holds that `expected` does not name;
    always, a tensor of both whose shape does not match (`shape_matches`). `model` names what
    implies the shapes (e.g. "config.json"), `where` the checkpoint."""
    if complete:
        missing = sorted(set(expected) - set(found))
        if missing:
            raise CheckpointError(f"{where} lacks tensor {missing[0]} ({len(missing)} missing) "
                                  f"that {model} implies; the checkpoint is incomplete or "
                                  f"{model} is of another model")
        extra = sorted(set(found) - set(expected))
        if extra:
            raise CheckpointError(f"{where}: tensor {extra[0]} is not part of the model {model} "
                                  "describes, as megamoe imports it (biases and extra modules "
                                  "are not supported)")
    for name in sorted(set(found) & set(expected)):
        shape, want = tuple(found[name]), expected[name]
        if not shape_matches(shape, want):
            raise CheckpointError(f"{where}: tensor {name} has shape {list(shape)} but {model} "
                                  f"implies {_shown(want)}; the weights and {model} differ")


def check_tensor(value: Any, name: str, where: str) -> torch.Tensor:
    """`value` if it is a floating-point tensor (FLOAT_DTYPES) whose storage holds every one of
    its elements, else one line: a number or other object, a sparse or meta tensor, an integer
    or boolean tensor (an int8 embedding is no weight megamoe trains), and a view whose elements
    share storage (an expanded tensor saved from a few bytes would be terabytes once
    written); and NaN or Inf values (`require_finite`)."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{where}: {name} holds {type(value).__name__!r}, not a tensor; "
                              "the checkpoint is corrupt or not a model's")
    if value.layout != torch.strided or value.is_meta:
        kind = "meta" if value.is_meta else str(value.layout).removeprefix("torch.")
        raise CheckpointError(f"{where}: tensor {name} is a {kind} tensor, not dense weights; "
                              "the checkpoint is corrupt or not a model's")
    if value.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{where}: tensor {name} has dtype {value.dtype}; only "
                              f"{'/'.join(str(d).split('.')[1] for d in FLOAT_DTYPES)} weights "
                              "convert (dequantise the model first)")
    needed = value.numel() * value.element_size()
    if value.untyped_storage().nbytes() < needed:
        raise CheckpointError(f"{where}: tensor {name} of shape {list(value.shape)} is a view "
                              f"of {value.untyped_storage().nbytes():,} bytes standing for "
                              f"{needed:,}; re-save it as a tensor of its own (.clone())")
    return require_finite(value, f"{where}: tensor {name}")
