"""Opt-in overrides that let Megatron-Core's local (non-Transformer-Engine) modules run on CPU.

Megatron-Core assumes CUDA in a handful of places that a GPTModel built from the local layer
spec (including Megatron's own MoE layer: TopKRouter, SequentialMLP, all-to-all dispatcher)
reaches on CPU with the gloo backend. `enable_megatron_on_cpu()` replaces exactly those places
with CPU equivalents. It is never applied on import, applies each override at most once, and
does nothing on a machine with CUDA. Checked against megatron-core 0.16.1 and 0.19.2. (What
breaks without apex or Transformer Engine on any device, torch's Adam among it, is repaired by
`megamoe.megatron.local_fallbacks`.)

What is not overridden, and how to avoid it instead:
- `attention_mask=None` makes local attention build its causal mask on "cuda": pass an explicit
  mask (`megamoe.megatron.masks.causal_attention_mask`).
- `use_cpu_initialization=False` allocates weights on the current CUDA device, and
  `add_bias_linear=True` trips an in-place-on-view autograd error in the MLP on CPU: set
  `use_cpu_initialization=True, add_bias_linear=False` (the tests' `tiny_transformer_config` does).

Megatron-Core's training components (DistributedDataParallel and its gradient buffers, the
distributed optimizer, gradient clipping, the pipeline schedules and their point-to-point
communication) allocate with `device="cuda"`, call `.cuda()` and check `tensor.type()` against
CUDA type names. Those entry points run inside `cuda_as_cpu()`, which puts every such
allocation on the CPU and lets the type checks accept the CPU types; set
`batch_p2p_comm=False` on CPU (gloo's point-to-point ops go one by one, no CUDA synchronise).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megamoe.megatron import compat

_APPLIED: list[str] = []

# Megatron's fork() warns when the CPU generator moves inside a fork; on CPU the forked
# generator *is* the CPU generator, so the warning is always a false alarm there.
_FALSE_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def _cpu_device() -> torch.device:
    return torch.device("cpu")


class _HostStream:
    """What a CUDA stream or event is on the CPU: work is done when it is issued, so waiting,
    recording and synchronising are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostStream()

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _host_stream(*args, **kwargs) -> _HostStream:
    return _HostStream()


def _no_op(*args, **kwargs) -> None:
    return None


# `torch.cuda` functions that Megatron-Core's training components call on every step (0.19's
# gradient sync asks for `current_stream()` each time; both versions build streams for
# overlapped communication and synchronise around buffers), and their CPU meaning.
_CUDA_ON_CPU = {
    "current_device": _cpu_device,
    "current_stream": _host_stream,
    "default_stream": _host_stream,
    "Stream": _HostStream,
    "Event": _HostStream,
    "stream": lambda stream=None: contextlib.nullcontext(),
    "synchronize": _no_op,
}


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    """Make `torch.cuda.current_device()` name the CPU while the block runs.

    The swap is process-wide for the duration; without CUDA the call could only raise anyway.
    """
    with _swapped_cuda_functions({"current_device": _cpu_device}):
        yield


@contextlib.contextmanager
def _swapped_cuda_functions(replacements: dict) -> Iterator[None]:
    originals = {name: getattr(torch.cuda, name) for name in replacements}
    for name, replacement in replacements.items():
        setattr(torch.cuda, name, replacement)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.cuda, name, original)


def _allocate_on_cpu(owner: object, name: str, context=_current_device_is_cpu) -> None:
    """Wrap `owner.name` so what it allocates on `torch.cuda.current_device()` lands on the CPU
    (or, with `context=cuda_as_cpu`, everything it puts on CUDA)."""
    raw = inspect.getattr_static(owner, name)
    is_static = isinstance(raw, staticmethod)
    function = raw.__func__ if is_static else raw

    @functools.wraps(function)
    def on_cpu(*args, **kwargs):
        with context():
            return function(*args, **kwargs)

    setattr(owner, name, staticmethod(on_cpu) if is_static else on_cpu)


_CUDA_TYPE_NAMES = {f"torch.{kind}Tensor": f"torch.cuda.{kind}Tensor"
                    for kind in ("Float", "Half", "BFloat16", "Int", "Long")}


def _is_cuda_device(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class _CudaAsCpuMode(TorchFunctionMode):
    """Torch calls that would allocate on CUDA allocate on `device` (the CPU by default): a
    `device` argument naming CUDA becomes `device`, `Tensor.cuda()` is the identity, and
    `Tensor.type()` reports tensors under their CUDA type names (Megatron's optimizer checks
    them)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args).replace("torch.meta.", "torch.")
            return _CUDA_TYPE_NAMES.get(name, name)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = self.device
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], self.device, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Run Megatron-Core code written for CUDA on the CPU (see `_CudaAsCpuMode`), with
    `torch.cuda.current_device()` naming the CPU and CUDA streams and events as host no-ops
    (`_CUDA_ON_CPU`). Only the overridden entry points use it."""
    with _swapped_cuda_functions(_CUDA_ON_CPU), _CudaAsCpuMode():
        yield


@contextlib.contextmanager
def cuda_as_meta() -> Iterator[None]:
    """As `cuda_as_cpu`, but what Megatron-Core's training components would put on CUDA lands
    on the meta device (shapes and dtypes, no memory): the memory planner builds a rank's
    gradient buffers and distributed optimizer this way. Explicit CPU allocations (the
    metadata of object collectives) stay on the CPU."""
    meta = {**_CUDA_ON_CPU, "current_device": lambda: torch.device("meta")}
    with _swapped_cuda_functions(meta), _CudaAsCpuMode("meta"):
        yield


def _patch_rng_tracker() -> None:
    """RNG tracker on the CPU generator (0.16.1, 0.19.2: `tensor_parallel/random.py`).

    `CudaRNGStatesTracker.add` seeds through `torch.cuda.get_rng_state/manual_seed`, and
    `fork` saves/restores through `_get_cuda_rng_state/_set_cuda_rng_state`. The tracked states
    become CPU generator states, so `model_parallel_cuda_manual_seed` and forked dropout work.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    def get_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: record.getMessage() != _FALSE_RNG_WARNING
    )


def _patch_router_device() -> None:
    """TopKRouter buffers and gating weights on CPU (0.16.1, 0.19.2: `transformer/moe/router.py`).

    `TopKRouter.__init__` registers `expert_bias`/`local_tokens_per_expert` (and the global
    aux-loss counters) on `torch.cuda.current_device()`, and `Router.gating` moves CPU weights
    there on every call.
    """
    from megatron.core.transformer.moe import router

    _allocate_on_cpu(router.TopKRouter, "__init__")
    _allocate_on_cpu(router.Router, "gating")


def _patch_alltoall_dispatcher() -> None:
    """All-to-all token dispatcher without CUDA streams (0.16.1, 0.19.2: `token_dispatcher.py`).

    `MoEAlltoAllTokenDispatcher.__init__` creates a class-wide `torch.cuda.Stream()` for its
    device-to-host copies, and `_maybe_dtoh_and_synchronize` copies the split sizes on it as
    numpy arrays. On CPU nothing needs copying or synchronising, but the split sizes must
    become Python lists: gloo's `all_to_all_single` rejects tensors.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def sync_on_cpu(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr, None)
                if torch.is_tensor(value):
                    setattr(self, attr, value.tolist())
        return tokens_per_expert

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        # Any non-None value stops __init__ from creating the stream; sync_on_cpu never uses it.
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on CPU"
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = sync_on_cpu


def _patch_collectives_device() -> None:
    """Collective output buffers on CPU (0.16.1, 0.19.2: `tensor_parallel/mappings.py`).

    With expert parallelism > 1 the dispatcher all-gathers token counts
    (`_gather_along_first_dim`) and exchanges tokens (`_AllToAll.forward`); both allocate
    their outputs on `torch.cuda.current_device()`.
    """
    from megatron.core.tensor_parallel import mappings

    _allocate_on_cpu(mappings, "_gather_along_first_dim")
    _allocate_on_cpu(mappings._AllToAll, "forward")


def _patch_memory_buffer_device() -> None:
    """Global memory buffer on CPU (0.16.1, 0.19.2: `utils.GlobalMemoryBuffer.get_tensor`).

    Local attention (`DotProductAttention.forward`) takes its score buffer from it, and it
    allocates on `torch.cuda.current_device()`.
    """
    from megatron.core import utils

    _allocate_on_cpu(utils.GlobalMemoryBuffer, "get_tensor")


def _patch_checkpoint_save() -> None:
    """`dist_checkpointing.save` without CUDA (0.16.1, 0.19.2: `dist_checkpointing/strategies/`).

    `FileSystemWriterAsync.preload_tensors(buckets, non_blocking=True)` copies tensors to host
    and then calls `torch.cuda.synchronize()`; on CPU the copy is synchronous, so it runs with
    `non_blocking=False`. `save_state_dict_async_finalize` broadcasts its failure flag from a
    tensor on `torch.cuda.current_device()`; 0.16.1 calls it through the name bound in
    `strategies/torch.py`, 0.19.x imports it from `state_dict_saver` at call time.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors

    def preload_on_cpu(write_buckets, non_blocking: bool = True):
        return preload(write_buckets, non_blocking=False)

    FileSystemWriterAsync.preload_tensors = staticmethod(preload_on_cpu)
    for module in compat.async_finalize_modules():
        _allocate_on_cpu(module, "save_state_dict_async_finalize")


def _patch_rotary_device() -> None:
    """Rotary embedding frequencies stay on CPU (0.16.1, 0.19.2:
    `models/common/embeddings/rotary_pos_embedding.py`, `yarn_rotary_pos_embedding.py`).

    `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` on its first
    call, and YaRN's `get_emb` its two frequency tables (the rotation itself,
    `apply_rotary_pos_emb` without `apply_rope_fusion`, is plain torch). Both constructors put
    the tables on `torch.cuda.current_device()` unless given `use_cpu_initialization`, which
    multi-head latent attention does not pass (GPTModel does). Llama 3's frequency scaling
    (`rope_scaling`) is applied in `__init__` and needs nothing more.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    for rotary in (RotaryEmbedding, YarnRotaryEmbedding):
        _allocate_on_cpu(rotary, "__init__")
        _allocate_on_cpu(rotary, "get_emb")


_OVERRIDES: dict[str, Callable[[], None]] = {
    "rng_tracker": _patch_rng_tracker,
    "memory_buffer_device": _patch_memory_buffer_device,
    "router_device": _patch_router_device,
    "alltoall_dispatcher": _patch_alltoall_dispatcher,
    "collectives_device": _patch_collectives_device,
    "checkpoint_save": _patch_checkpoint_save,
    "rotary_device": _patch_rotary_device,
}


def enable_megatron_on_cpu() -> list[str]:
    """Apply the CPU overrides to the imported megatron-core; return the names applied so far.

    Idempotent: a second call changes nothing. With CUDA available it applies nothing and
    returns an empty list, since Megatron's own CUDA paths are then the right ones.
    """
    if torch.cuda.is_available():
        return []
    for name, apply in _OVERRIDES.items():
        if name not in _APPLIED:
            apply()
            _APPLIED.append(name)
    return list(_APPLIED)


def cpu_transformer_config(**fields):
    """A Megatron-Core TransformerConfig of `fields` that its local modules can run on the CPU:
    weights initialised on the CPU, no linear biases (see the module docstring), fp32 unless
    `fields` say otherwise."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**{"use_cpu_initialization": True, "add_bias_linear": False,
                                "params_dtype": torch.float32, **fields})
