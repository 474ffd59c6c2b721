"""Load `torch.save` data from checkpoints (Megatron-LM's legacy `model_optim_rng.pt`, torch_dist
`common.pt`, and the serialized sharded objects inside `.distcp` files) with `weights_only=True`.

Megatron-LM stores its argparse `args` (which may hold Megatron enums) and numpy RNG states next
to the weights. Those types are allowed explicitly, and only those; any other global in the data
is refused with a CheckpointError naming the file and the type. Names are checked before any
module is imported, so a crafted name cannot import arbitrary code either.
"""
from __future__ import annotations

import argparse
import enum
import importlib
import io
import os
import pickle
import zipfile
from typing import IO, Any, Optional

import numpy as np
import torch

from megamoe.bounded import regular_file_size
from megamoe.errors import CheckpointError

_NUMPY_ARRAY_TYPES = ("numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                      "numpy._core.multiarray._reconstruct")
_READ_ERRORS = (RuntimeError, ValueError, OSError, EOFError, zipfile.BadZipFile,
                pickle.UnpicklingError, KeyError, IndexError, TypeError, AttributeError,
                UnicodeDecodeError, OverflowError, MemoryError)
MAX_TORCH_FILE_BYTES = 1 << 44  # 16 TiB: a size beyond any checkpoint file is damage


def _resolve(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError):
        return None


def _allowed_object(name: str) -> Optional[Any]:
    """The object `name` designates if it is allowed (Namespace, numpy arrays and dtypes for RNG
    states, enums defined by Megatron), else None. Only allowed prefixes are ever imported."""
    if name == "argparse.Namespace":
        return argparse.Namespace
    if name in _NUMPY_ARRAY_TYPES:
        return _resolve(name)
    if name.startswith("numpy.dtypes."):
        obj = _resolve(name)
        return obj if isinstance(obj, type) and issubclass(obj, np.dtype) else None
    if name.startswith("megatron."):
        obj = _resolve(name)
        return obj if isinstance(obj, type) and issubclass(obj, enum.Enum) else None
    return None


def refused(where: str, name: str) -> CheckpointError:
    """The error for a disallowed type `name` found in `where`."""
    return CheckpointError(f"{where} contains the type {name}, which is not on the allow-list of "
                           "checkpoint types and was not loaded; only load checkpoints you trust "
                           "the origin of, re-saved without it")


def _safe_load(source: str | os.PathLike | IO[bytes], where: str, mmap: bool = False) -> Any:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except FileNotFoundError:
        raise CheckpointError(f"{where} does not exist; the checkpoint is incomplete") from None
    except _READ_ERRORS as err:
        raise CheckpointError(f"{where} is not a readable torch file ({first_line(err)}); the "
                              "checkpoint is corrupt or was not written by torch.save") from None
    objects = {name: _allowed_object(name) for name in sorted(names)}
    for name, obj in objects.items():
        if obj is None:
            raise refused(where, name)
    # The context removes what it added on exit: leave globals others registered (Megatron
    # registers Namespace and its enums on import) in place.
    registered = set(map(id, torch.serialization.get_safe_globals()))
    extra = [obj for obj in objects.values() if id(obj) not in registered]
    if hasattr(source, "seek"):
        source.seek(0)
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except _READ_ERRORS as err:
        raise CheckpointError(f"{where} could not be loaded ({first_line(err)}); the checkpoint "
                              "is corrupt or incomplete") from None


def load_torch_file(path: str | os.PathLike, mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)` allowing Megatron-LM's metadata types.

    mmap: map tensor storages from the file instead of reading them (they are paged in when
    used), so opening a large file costs little memory. A device, FIFO or folder in the file's
    place is refused before it is opened.
    """
    if os.path.lexists(path):  # a missing file: _safe_load says the checkpoint is incomplete
        regular_file_size(path, MAX_TORCH_FILE_BYTES, CheckpointError, f"torch file {path}")
    return _safe_load(path, str(path), mmap=mmap)


def load_torch_bytes(data: bytes | io.BytesIO, where: str) -> Any:
    """`load_torch_file` for serialized bytes (a sharded object); `where` names them in errors."""
    buffer = io.BytesIO(data) if isinstance(data, bytes) else data
    return _safe_load(buffer, where)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for one-line errors."""
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def require_finite(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """`tensor`, refused (one-line CheckpointError naming `what`) if it holds NaN or Inf: a
    conversion never carries non-finite weights into its output without a word."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"{what} holds {bad:,} NaN/Inf values; the input checkpoint is "
                              "corrupt or diverged: convert a healthy one")
    return tensor
