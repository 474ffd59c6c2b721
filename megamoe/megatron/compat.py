"""Every difference between the megatron-core versions megamoe supports, in one place.

megamoe supports megatron-core 0.16.1 (the newest release for Python 3.11) and 0.19.x (Python
3.12, what NVIDIA's PyTorch containers ship). Each entry below names the version whose behaviour
it follows, what changed there and what megamoe does about it; no other module checks a version,
an attribute that only one version has, or a signature. `tests/unit/test_megatron_compat.py`
checks every entry on the installed version (CI runs it on both).

| since | what changed in megatron-core | entry |
|---|---|---|
| 0.19 | the local GPT spec holds its dense MLP as `functools.partial(MLP.as_mlp_submodule, submodules=...)`, not a `ModuleSpec(MLP, submodules=...)`; `get_moe_module_spec` returns a builder | `replace_submodules`, `build_from_spec` |
| 0.19 | MoE metrics live in a `MoEMetricsTracker` object; `get_moe_layer_wise_logging_tracker()` returns a rebuilt copy of its entries, so deleting or clearing the copy does nothing | `tracker_entries`, `drop_tracker_entry`, `reset_moe_tracker` |
| 0.19 (Megatron-LM main) | the tracker's `report(track_names=...)` reports only the names asked for (0.16's `track_moe_metrics` reports every entry) | `install_reporting_tracker` |
| 0.19 | `dist_checkpointing.save` writes the common state as the sharded object `common_state`, not `common.pt`; `load` takes no `common_strategy` and reads the common state itself | `load_takes_common_strategy` (checkpoints of either form are read by `megamoe.checkpointing.safe_dcp`) |
| 0.19 | `serialization` imports `_get_filesystem_reader` by name from `strategies.torch` | `filesystem_reader_modules` |
| 0.19 | `save_state_dict_async_finalize` is imported from `state_dict_saver` at call time, not bound in `strategies.torch` | `async_finalize_modules` |
| 0.19 | a torch_dist writer's exception (e.g. ENOSPC) reaches the caller only as its class name; the message is only logged | `checkpoint_writer_errors` |
| 0.19 | the gradient buffers' `start_grad_sync` / `finish_grad_sync` call `torch.cuda.current_stream()` on every sync (0.16 touched streams only with overlapping communication) | covered version-independently by `megamoe.megatron.cpu.cuda_as_cpu` (stand-in streams and events) |
| 0.16 only | `moe_utils.te_general_gemm` is referenced but undefined without Transformer Engine | `te_general_gemm_missing` |
| 0.16 only | `multi_latent_attention.HAVE_TE` is True without Transformer Engine (its TE names are stand-in mocks), so MLA's `isinstance(linear_proj, TELinear)` raises | `mla_claims_transformer_engine` |
| 0.19 | MLA resolves its query/key-value norms and projections through `QKNormConfigResolver`, which wants a fused norm+linear query projection when `q_lora_rank` is None | `mla_qk_norm_resolver` |
| 0.19 | `get_gpt_layer_local_spec` lost `moe_use_legacy_grouped_gemm`, and the legacy `GroupedMLP` is gone | `HAS_LEGACY_GROUPED_MLP` |
| 0.16 only | `BlendedDataset` asks torch.distributed for the rank even without a process group | `process_group_for_dataset_build` |
| 0.19 | TransformerLayer builds a plugin mlp with `config, pg_collection, is_mtp_layer, name` (0.16: `config` only) | handled by `MegatronMoELayer.__init__`'s signature, which takes both |
| 0.19 | Megatron-LM's model builder calls a `--spec` object that is callable and not a ModuleSpec | handled by `megamoe.megatron.specs` (ModuleSpecs, callable as spec functions) |
| 0.19 | the MTP loss logger keeps its per-depth sums under `loss_values` (0.16: `values`), beside acceptance counts | `take_mtp_losses`, `reset_mtp_losses` |
| 0.19 | a multi-token-prediction depth's TransformerLayer (and the mlp it builds, told `is_mtp_layer`) is numbered k = 1..D, not num_layers + k | `global_layer_number` |
| 0.19 | a multi-token-prediction depth holds its TransformerLayer as `mtp_model_layer` (0.16: `transformer_layer`; both save it under `transformer_layer.`) | `mtp_transformer_layer` |
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from types import ModuleType
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import package_info

MCORE_VERSION: tuple[int, int, int] = (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
SUPPORTED = ((0, 16), (0, 19))
"""The (major, minor) versions megamoe is tested with, one CI leg each."""

SINCE_0_19 = MCORE_VERSION >= (0, 19, 0)
HAS_LEGACY_GROUPED_MLP = not SINCE_0_19
"""Whether `moe_use_legacy_grouped_gemm` and the legacy GroupedMLP exist (until 0.18)."""


def version_string() -> str:
    return ".".join(map(str, MCORE_VERSION))


# ---- layer specs --------------------------------------------------------------------------

def replace_submodules(spec: Any, **submodules: Any) -> Any:
    """`spec` with some of its submodules replaced: a ModuleSpec (0.16's dense MLP, every
    layer spec) or a `functools.partial(..., submodules=...)` (0.19's dense MLP builder)."""
    if isinstance(spec, functools.partial):
        keywords = dict(spec.keywords)
        keywords["submodules"] = dataclasses.replace(keywords["submodules"], **submodules)
        return functools.partial(spec.func, *spec.args, **keywords)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                    **submodules))


def build_from_spec(spec: Any, **kwargs: Any) -> Any:
    """Build a module from what Megatron's spec functions return: a ModuleSpec (0.16) or, for
    several MLP and MoE specs from 0.19, a builder (`functools.partial`) called directly."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    return build_module(spec, **kwargs) if isinstance(spec, ModuleSpec) else spec(**kwargs)


# ---- multi-token prediction ---------------------------------------------------------------

def global_layer_number(layer_number: int, config: Any, is_mtp_layer: bool) -> int:
    """The global 1-based number of a layer Megatron-Core numbers `layer_number`, MTP depths
    after the decoder's layers (num_layers + k): 0.16 numbers depth k's layer so already, from
    0.19 it is k and marked `is_mtp_layer` (a TransformerLayer's attribute, a keyword to the mlp
    it builds); nothing else is renumbered."""
    return config.num_layers + layer_number if is_mtp_layer else layer_number


def transformer_layer_number(layer: Any) -> int:
    """`global_layer_number` of a built TransformerLayer."""
    return global_layer_number(layer.layer_number, layer.config,
                               bool(getattr(layer, "is_mtp_layer", False)))


def mtp_transformer_layer(depth: Any) -> Any:
    """The TransformerLayer of a built MultiTokenPredictionLayer `depth`."""
    return depth.mtp_model_layer if SINCE_0_19 else depth.transformer_layer


def _mtp_tracker() -> dict:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return MTPLossLoggingHelper.tracker


def take_mtp_losses() -> Optional[torch.Tensor]:
    """The per-depth MTP losses Megatron-Core's GPTModel recorded on this rank since the last
    call (each training micro-batch's mean token loss of depth k, summed over micro-batches;
    None where it recorded none: off the last pipeline stage), on the CPU; the record is
    zeroed for the next step."""
    tracker = _mtp_tracker()
    values = tracker.get("loss_values" if SINCE_0_19 else "values")
    if values is None:
        return None
    taken = values.detach().float().cpu().clone()
    for value in tracker.values():
        if isinstance(value, torch.Tensor):
            value.zero_()
    return taken


def reset_mtp_losses() -> None:
    """Forget Megatron-Core's MTP loss record (sized for the model that made it)."""
    _mtp_tracker().clear()


# ---- the MoE logging tracker --------------------------------------------------------------

def _metrics_tracker():
    """0.19's tracker object (None on 0.16, whose tracker is a plain dict)."""
    if not SINCE_0_19:
        return None
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker()


def _tracker_dict() -> dict:
    """0.16's tracker: the live dict, name -> {"values": per-layer tensor, ...}."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return get_moe_layer_wise_logging_tracker()


def tracker_entries() -> dict[str, torch.Tensor]:
    """The live per-layer value tensor of every entry of Megatron's MoE logging tracker."""
    tracker = _metrics_tracker()
    if tracker is None:
        return {name: entry["values"] for name, entry in _tracker_dict().items()}
    return {name: entry.values for name, entry in tracker.metrics.items()}


def drop_tracker_entry(name: str) -> None:
    """Remove one entry (it is re-created at the next record, sized for the current model)."""
    tracker = _metrics_tracker()
    (_tracker_dict() if tracker is None else tracker.metrics).pop(name, None)


def reset_moe_tracker() -> None:
    """Remove every entry of Megatron's MoE logging tracker."""
    tracker = _metrics_tracker()
    (_tracker_dict() if tracker is None else tracker.metrics).clear()


def install_reporting_tracker(extra_names: tuple[str, ...]) -> None:
    """From 0.19 (and at Megatron-LM main), `report(track_names=[...])` reports only the names
    Megatron-LM asks for (its aux-loss types and z-loss). Install, through Megatron's own
    `set_moe_metrics_tracker`, a tracker that also reports `extra_names` whenever a caller
    names what to track, so megamoe's load metrics reach the console, TensorBoard and wandb as
    they do under 0.16. The same names are added on every rank (with `force_initialize`, ranks
    without MoE layers create them too), so the cross-rank reductions stay matched.
    Idempotent; nothing to do on 0.16, whose `track_moe_metrics` reports every entry."""
    tracker = _metrics_tracker()
    if tracker is None or getattr(tracker, "megamoe_extra_names", None) == extra_names:
        return
    from megatron.core.transformer.moe.moe_logging import set_moe_metrics_tracker

    base = type(tracker)

    class ReportingTracker(base):
        """Megatron's MoE metrics tracker, reporting megamoe's load metrics too."""

        megamoe_extra_names = extra_names

        def report(self, *args: Any, track_names: Any = None, **kwargs: Any) -> str:
            if track_names is not None:
                names = [track_names] if isinstance(track_names, str) else list(track_names)
                track_names = names + [n for n in extra_names if n not in names]
            return super().report(*args, track_names=track_names, **kwargs)

    replacement = ReportingTracker.__new__(ReportingTracker)
    replacement.__dict__.update(tracker.__dict__)  # keeps the entries recorded so far
    set_moe_metrics_tracker(replacement)


# ---- distributed checkpoints --------------------------------------------------------------

def load_takes_common_strategy() -> bool:
    """Whether `dist_checkpointing.load` takes a `common_strategy` (until 0.18; from 0.19 it
    reads the common state itself)."""
    from megatron.core import dist_checkpointing

    return "common_strategy" in inspect.signature(dist_checkpointing.load).parameters


def filesystem_reader_modules() -> list[ModuleType]:
    """The modules through which Megatron's torch_dist loading builds its DCP reader by the
    name `_get_filesystem_reader`: `strategies.torch` (both), and `serialization` from 0.19."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    return [m for m in (torch_strategy, serialization) if hasattr(m, "_get_filesystem_reader")]


def async_finalize_modules() -> list[ModuleType]:
    """Where `save_state_dict_async_finalize` is looked up when a save finishes:
    `strategies.torch` binds it in 0.16; `state_dict_saver` (both) is where 0.19 imports it
    from at call time."""
    from megatron.core.dist_checkpointing.strategies import state_dict_saver
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    return [m for m in (state_dict_saver, torch_strategy)
            if hasattr(m, "save_state_dict_async_finalize")]


@contextlib.contextmanager
def checkpoint_writer_errors() -> Iterator[list[str]]:
    """The messages Megatron's torch_dist writer logs at ERROR while the block runs. From 0.19
    a writer's exception reaches the caller as `AssertionError(<class 'OSError'>)` inside
    "Worker failure: ..."; what it was (e.g. "No space left on device") is only logged, as
    "Local worker N encountered an error: ...". (0.16 passes the exception on.)"""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    handler = Collect(level=logging.ERROR)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


# ---- modules without Transformer Engine ---------------------------------------------------

def te_general_gemm_missing() -> bool:
    """0.16 only: the router's gating GEMM tests `moe_utils.te_general_gemm is not None`, a
    name that 0.16 binds only when Transformer Engine imports (0.19 binds it to None)."""
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def mla_claims_transformer_engine() -> bool:
    """0.16 only: `multi_latent_attention` sets `HAVE_TE` when importing Megatron's Transformer
    Engine extension succeeds, which it does without Transformer Engine (0.19 takes the
    extension's own `HAVE_TE`, False without it)."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention

    return multi_latent_attention.HAVE_TE and not te_extension.HAVE_TE


def mla_qk_norm_resolver() -> Any:
    """0.19: the class through which MLA resolves its latent norms and up projections
    (`transformer/mla_qk_norm_config.py`); None on 0.16, whose MLA builds the spec's modules."""
    try:
        from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    except ImportError:
        return None
    return QKNormConfigResolver


def legacy_grouped_gemm_kwargs(legacy: bool) -> dict:
    """`get_moe_module_spec` keywords asking for the legacy GroupedMLP (until 0.18)."""
    return {"moe_use_legacy_grouped_gemm": True} if legacy and HAS_LEGACY_GROUPED_MLP else {}


# ---- datasets -----------------------------------------------------------------------------

@contextlib.contextmanager
def process_group_for_dataset_build() -> Iterator[None]:
    """0.16 only: `BlendedDataset` asks torch.distributed for the rank even when no process
    group exists. Without one, a one-rank gloo group exists for the duration of the build (a
    world of one makes every rank check true; harmless on 0.19, so applied on both)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
