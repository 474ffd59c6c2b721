"""What a training rank really holds, by category: the storages of parameters, gradients and
optimizer state, and the peak of the tensors autograd keeps for the backward pass.

Storages are counted once each, whole (a view of a large buffer counts the buffer), by their
identity (the StorageImpl every view shares; meta tensors have one too), so a tensor seen under
two names is not counted twice. The tensors autograd saves are
followed through `torch.autograd.graph.saved_tensors_hooks`: a saved tensor is live from the
moment it is packed until the graph node holding it is freed (after its backward, or with its
graph), which is exactly what the pipeline schedule's in-flight micro-batches keep. A storage
takes the category of the region it was first saved in, except the MoE layer's input, which is
an ordinary activation wherever it is saved (see `SavedTensorTracker.region`).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

ACTIVATIONS = "activations"
MOE = "moe_dispatch"


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage (its StorageImpl, shared by every view of it; meta
    tensors too, which have no address)."""
    return tensor.untyped_storage()._cdata


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: Optional[set] = None
                  ) -> tuple[int, set]:
    """Bytes of the distinct storages behind `tensors` (those in `exclude` left out), and their
    keys."""
    seen: dict = {}
    for tensor in tensors:
        if tensor is None:
            continue
        key = storage_key(tensor)
        if (exclude is None or key not in exclude) and key not in seen:
            seen[key] = tensor.untyped_storage().nbytes()
    return sum(seen.values()), set(seen)


class _Held:
    """A saved tensor as the graph keeps it; releasing it releases its bytes."""

    __slots__ = ("tracker", "key", "tensor")

    def __init__(self, tracker: "SavedTensorTracker", key, tensor: torch.Tensor):
        self.tracker, self.key, self.tensor = tracker, key, tensor

    def __del__(self):
        self.tracker._release(self.key)


class SavedTensorTracker:
    """Live and peak bytes of saved-for-backward tensors per category (`ACTIVATIONS`, `MOE`).

    `exclude`: storage keys never counted (parameters, gradient buffers). Use as a context
    manager around forward and backward passes; while `current` is MOE, newly saved storages
    are MoE dispatch and expert buffers; `as_activation(t)` keeps a tensor entering such a
    region (the layer's input) an ordinary activation (until `forget_hints`)."""

    def __init__(self, exclude: set, log: Optional[list] = None):
        self.exclude = exclude
        self.log = log  # when a list: (category, shape, dtype, bytes) of each new storage
        self.current = ACTIVATIONS
        self.live = {ACTIVATIONS: 0, MOE: 0}
        self.peak = dict(self.live)
        self._held: dict = {}  # key -> [references, bytes, category]
        self._hinted: dict = {}

    def _pack(self, tensor: torch.Tensor):
        if not tensor.untyped_storage().nbytes():
            return tensor
        key = storage_key(tensor)
        if key in self.exclude:
            return tensor
        entry = self._held.get(key)
        if entry is None:
            category = self._hinted.get(key, self.current)
            entry = self._held[key] = [0, tensor.untyped_storage().nbytes(), category]
            self.live[category] += entry[1]
            self._update_peaks()
            if self.log is not None:
                self.log.append((category, tuple(tensor.shape), str(tensor.dtype), entry[1]))
        entry[0] += 1
        return _Held(self, key, tensor)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key) -> None:
        entry = self._held.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._held[key]
            self.live[entry[2]] -= entry[1]

    def _update_peaks(self) -> None:
        for category, value in self.live.items():
            self.peak[category] = max(self.peak[category], value)

    def as_activation(self, tensor: torch.Tensor) -> None:
        """`tensor`'s storage counts as an activation wherever it is saved."""
        self._hinted[storage_key(tensor)] = ACTIVATIONS

    def forget_hints(self) -> None:
        self._hinted.clear()

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)
