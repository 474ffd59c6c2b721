"""Load Megatron's `torch.save` files (legacy `model_optim_rng.pt`, torch_dist `common.pt`) with
`weights_only=True`.

Megatron-LM stores its argparse `args` (which may hold Megatron enums) and numpy RNG states next
to the weights. Those types are allowed explicitly, and only those; any other global in the file
is refused with a CheckpointError that names it.
"""
from __future__ import annotations

import argparse
import enum
import importlib
import os
import pickle
import zipfile
from typing import Any

import numpy as np
import torch

from megamoe.errors import CheckpointError

_NUMPY_ARRAY_TYPES = ("numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                      "numpy._core.multiarray._reconstruct")


def _resolve(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return None


def _allowed(name: str, obj: Any) -> bool:
    """Namespace, numpy arrays and dtypes (RNG states), and enums defined by Megatron."""
    if obj is argparse.Namespace or name in _NUMPY_ARRAY_TYPES:
        return obj is not None
    if name.startswith("numpy.dtypes.") and isinstance(obj, type) and issubclass(obj, np.dtype):
        return True
    return (isinstance(obj, type) and issubclass(obj, enum.Enum)
            and name.startswith("megatron."))


def load_torch_file(path: str | os.PathLike, mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)` allowing Megatron-LM's metadata types.

    mmap: map tensor storages from the file instead of reading them (they are paged in when
    used), so opening a large file costs little memory.
    """
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist; the checkpoint is incomplete") from None
    except (RuntimeError, ValueError, OSError, EOFError, zipfile.BadZipFile,
            pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path} is not a readable torch file ({_first_line(err)}); the "
                              "checkpoint is corrupt or was not written by torch.save") from None
    objects = {name: _resolve(name) for name in names}
    refused = sorted(name for name, obj in objects.items() if not _allowed(name, obj))
    if refused:
        raise CheckpointError(f"{path} contains types that cannot be loaded safely "
                              f"(weights_only): {refused}; re-save the checkpoint without them")
    # The context removes what it added on exit: leave globals others registered (Megatron
    # registers Namespace and its enums on import) in place.
    registered = set(map(id, torch.serialization.get_safe_globals()))
    extra = [obj for obj in objects.values() if id(obj) not in registered]
    try:
        with torch.serialization.safe_globals(extra):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, OSError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{path} could not be loaded ({_first_line(err)}); the checkpoint "
                              "is corrupt or incomplete") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
