"""Reading PyTorch Distributed Checkpoints (DCP) and Megatron-Core torch_dist checkpoints with
every pickle restricted to an allow-list.

PyTorch's `FileSystemReader.read_metadata` unpickles `.metadata` with plain `pickle.load`, and
its `DefaultLoadPlanner.load_bytes` deserializes sharded objects (Megatron's `rng_state`, extra
state) with `torch.load(weights_only=False)`: both run whatever a crafted file asks for.
`SafeFileSystemReader` reads `.metadata` through `MetadataUnpickler` (only DCP's metadata
classes, torch sizes and dtypes, plain containers) and checks each sharded object with
`load_torch_bytes` (weights_only, see torch_files) before the planner deserializes it; a
refused type is a CheckpointError naming the file and the type.

Megatron-Core's torch_dist strategy builds its reader with the module function
`megatron.core.dist_checkpointing.strategies.torch._get_filesystem_reader` (0.16.1 .. 0.19.x;
0.19 also imports it by name into `serialization`) and loads `common.pt` with `torch.load`.
`load_dist_checkpoint` is megamoe's one entry to Megatron's `dist_checkpointing.load`: it reads
`.metadata` and the common state through the allow-lists first, hands Megatron a common strategy
that loads through `load_torch_file` (0.16, whose `load` takes one), and replaces
`_get_filesystem_reader` for the duration of the call only (the one override of a Megatron
function here), so every pickle Megatron reads is restricted. Megatron-Core 0.19 writes the
common state as the sharded object `common_state` instead of `common.pt`; `load_common_state`
reads either.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megamoe.bounded import regular_file_size
from megamoe.checkpointing.torch_files import (MAX_TORCH_FILE_BYTES, first_line,
                                              load_torch_bytes, load_torch_file, refused)
from megamoe.errors import CheckpointError, MegaMoEError
from megamoe.paths import inside

COMMON_FILE = "common.pt"
# The sharded object that holds the common state in megatron-core >= 0.19 checkpoints.
COMMON_STATE_KEY = "common_state/shard_0_1"
# What a failing DCP / Megatron load or save raises: DCP's per-rank CheckpointException is a
# BaseException, not an Exception.
FAILURES = (Exception, CheckpointException)
METADATA_FILE = ".metadata"
# The tensors whose first axis is the padded vocabulary (and the optimizer's states of them).
VOCAB_TENSORS = ("word_embeddings.weight", "output_layer.weight")
# What torch's FileSystemWriter and Megatron's FileSystemWriterAsync pickle into `.metadata`.
_DCP_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
        "LoadPlan", "ReadItem", "LoadItemType"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


# torch constants a TensorProperties may pickle by name (older torch pickles layouts directly).
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP `.metadata`: only `_DCP_TYPES` and torch dtypes, layouts and memory
    formats; anything else raises."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_TYPES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise refused(self.where, f"{module}.{name}")


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP `Metadata` pickled in the file `path`, through `MetadataUnpickler` (a device,
    FIFO or folder in its place is refused before it is opened)."""
    if os.path.lexists(path):  # a missing file is named below as an incomplete checkpoint
        regular_file_size(path, MAX_TORCH_FILE_BYTES, CheckpointError, str(path))
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, str(path)).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the torch_dist checkpoint is incomplete") \
            from None
    except MegaMoEError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of a corrupt pickle is one line
        raise CheckpointError(f"{path} is corrupt ({type(err).__name__}: {first_line(err)}); "
                              "restore the checkpoint or use another one") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; the "
                              "checkpoint is corrupt")
    _check_storage(metadata, Path(path))
    return metadata


def _check_storage(metadata: Metadata, path: Path) -> None:
    """Every storage file `.metadata` names lies inside the checkpoint folder (so the folder's
    manifest covers every byte a load reads), and every byte range it gives lies inside its
    file."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or not all(isinstance(v, int) and v >= 0
                                                for v in (offset, length)):
            raise CheckpointError(f"{path} has a malformed storage entry; the checkpoint is "
                                  "corrupt")
        if name not in sizes:
            file = inside(path.parent, name)
            sizes[name] = file.stat().st_size if file.is_file() else -1
        if sizes[name] >= 0 and offset + length > sizes[name]:
            raise CheckpointError(f"{path} reads bytes {offset}..{offset + length} of {name}, "
                                  f"which has {sizes[name]}; the checkpoint is corrupt")


class _CheckedPlanner:
    """A load planner whose `load_bytes` first checks the serialized object (weights_only)."""

    def __init__(self, planner, directory: Path):
        self._planner, self._directory = planner, directory

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        load_torch_bytes(value, f"{self._directory} (sharded object {read_item.dest_index.fqn})")
        value.seek(0)
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's `FileSystemReader` with allow-listed `.metadata` and sharded-object unpickling."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _CheckedPlanner(planner, Path(self.path)))


def common_state_problem(directory: str | os.PathLike) -> Optional[str]:
    """None if the torch_dist checkpoint `directory` holds its common state (`common.pt`, or
    the sharded object `common_state` of megatron-core >= 0.19), else one line saying what is
    missing."""
    directory = Path(directory)
    if (directory / COMMON_FILE).is_file():
        return None
    try:
        names = read_dcp_metadata(directory / METADATA_FILE).state_dict_metadata
    except CheckpointError as err:
        return str(err)
    if COMMON_STATE_KEY in names:
        return None
    return (f"{directory / COMMON_FILE} is missing and {directory / METADATA_FILE} names no "
            "common_state object (megatron-core >= 0.19); the checkpoint is incomplete")


def load_common_state(directory: str | os.PathLike) -> dict:
    """A torch_dist checkpoint's common (non-sharded) state, weights_only: `common.pt`, or the
    sharded object `common_state` of megatron-core >= 0.19."""
    directory = Path(directory)
    path = directory / COMMON_FILE
    if path.is_file():
        common = load_torch_file(path)
    elif COMMON_STATE_KEY in read_dcp_metadata(directory / METADATA_FILE).state_dict_metadata:
        common = _read_common_state_object(directory)
    else:
        raise CheckpointError(f"{path} is missing; {directory} is not a complete torch_dist "
                              "checkpoint")
    if not isinstance(common, dict):
        raise CheckpointError(f"{path} holds a {type(common).__name__}, not a state dict; the "
                              "checkpoint is corrupt")
    return common


def _read_common_state_object(directory: Path) -> Any:
    """The `common_state` sharded object (megatron-core >= 0.19), read as Megatron does, through
    `SafeFileSystemReader`."""
    from torch.distributed import checkpoint as dcp

    state = {COMMON_STATE_KEY: io.BytesIO()}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(directory), no_dist=True)
    except FAILURES as err:
        cause = _megamoe_cause(err)
        raise cause or CheckpointError(f"{directory}: cannot read its common state "
                                       f"({first_line(err)}); the checkpoint is corrupt") from None
    loaded = state[COMMON_STATE_KEY]
    if isinstance(loaded, io.BytesIO):
        loaded = load_torch_bytes(loaded.getvalue(), f"{directory} (sharded object common_state)")
    return loaded[0]


@functools.lru_cache(maxsize=None)
def _safe_common_strategy() -> type:
    """Megatron's common-state load strategy (megatron-core < 0.19) with restricted unpickling.

    Built on first use: importing megatron.core.dist_checkpointing is slow and noisy, and the
    upcycler's DCPReader does not need it.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        """Loads `common.pt` and sharded-object files weights_only."""

        def load_common(self, checkpoint_dir):
            return load_common_state(checkpoint_dir)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            def load(sh_obj):
                return load_torch_file(Path(checkpoint_dir) / f"{sh_obj.unique_key}.pt")
            return dict_list_map_inplace(load, sharded_objects_state_dict)

    return SafeCommonLoadStrategy


@functools.lru_cache(maxsize=None)
def _safe_cached_reader() -> type:
    """Megatron's metadata-caching DCP reader over `SafeFileSystemReader` (built on first use)."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader)

    class SafeCachedMetadataFileSystemReader(CachedMetadataFileSystemReader,
                                             SafeFileSystemReader):
        """Megatron's metadata-caching reader over `SafeFileSystemReader`."""

    return SafeCachedMetadataFileSystemReader


@contextlib.contextmanager
def _restricted_megatron_readers() -> Iterator[None]:
    from megamoe.megatron import compat

    cached_reader = _safe_cached_reader()

    def safe_reader(checkpoint_dir, cache_metadata: bool = False, **_):
        return (cached_reader if cache_metadata else SafeFileSystemReader)(checkpoint_dir)

    modules = compat.filesystem_reader_modules()
    originals = [m._get_filesystem_reader for m in modules]
    for module in modules:
        module._get_filesystem_reader = safe_reader
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module._get_filesystem_reader = original


def load_dist_checkpoint(request: dict, directory: str | os.PathLike,
                         vocab_size: Optional[int] = None, **kwargs) -> Any:
    """Megatron's `dist_checkpointing.load(request, directory, **kwargs)`, every pickle
    restricted. `.metadata` is read (restricted) first: DCP's loader swallows a failing
    `read_metadata` into an AssertionError. A refused type or corrupt file inside DCP's
    collective wrappers comes out as the CheckpointError that caused it. `vocab_size`, the
    run's real vocabulary (its tokenizer's), lets the vocabulary tensors differ from the
    checkpoint's in their padding rows (`_check_global_shapes`)."""
    from megatron.core import dist_checkpointing

    from megamoe.megatron import compat

    _check_global_shapes(request, read_dcp_metadata(Path(directory) / METADATA_FILE),
                         Path(directory), vocab_size)
    if compat.load_takes_common_strategy():
        kwargs["common_strategy"] = _safe_common_strategy()()
    else:  # megatron-core >= 0.19 reads the common state itself: check it through ours first
        load_common_state(directory)
    try:
        with _restricted_megatron_readers():
            return dist_checkpointing.load(request, str(directory), **kwargs)
    except MegaMoEError:
        raise
    except FAILURES as err:
        cause = _megamoe_cause(err)
        if cause is not None:
            raise cause from None
        raise


def _check_global_shapes(request: dict, metadata: Metadata, directory: Path,
                         vocab_size: Optional[int] = None) -> None:
    """Every tensor the load asks for has the global shape the checkpoint saved (DCP itself
    reads the overlap of a larger request and leaves the rest as it was: a model with a larger
    vocabulary would train on random embedding rows), but for the padding of the vocabulary.

    Megatron-Core pads the vocabulary to a multiple of make_vocab_size_divisible_by x the
    tensor-parallel size, so the embedding and output layer saved at another layout have
    another number of padding rows beyond the real vocabulary. Given `vocab_size` (the run's
    real vocabulary), such a tensor loads when both its saved and its requested rows cover
    the real vocabulary: Megatron-Core marks these tensors `allow_shape_mismatch`, and the
    optimizer's states of them keep the mark, so its torch_dist loader (strategies/torch.py)
    zero-fills the requested tensor and reads the rows both have. The real rows (weights, Adam
    moments, fp32 main weights) arrive bit-identical, saved padding rows the model lacks are
    dropped, and padding rows the checkpoint lacks start at zero: zero weights (logit 0 in
    the output layer) and zero moments, a fresh Adam state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = metadata.state_dict_metadata
    for tensor in nested_values(request):
        if not isinstance(tensor, ShardedTensor):
            continue
        size = getattr(saved.get(tensor.key), "size", None)
        if size is None or tuple(size) == tuple(tensor.global_shape):
            continue
        vocabulary = tensor.key.endswith(VOCAB_TENSORS)
        if vocabulary and vocab_size is not None and tensor.allow_shape_mismatch and \
                tuple(size[1:]) == tuple(tensor.global_shape[1:]) and \
                min(size[0], tensor.global_shape[0]) >= vocab_size:
            continue
        hint = ""
        if vocabulary and tuple(size[1:]) == tuple(tensor.global_shape[1:]):
            hint = (f" (a vocabulary of {size[0]}: train with the model's tokenizer, or with "
                    f"data.vocab_size={size[0]} on the default corpus)" if vocab_size is None
                    else f" ({size[0]} rows, fewer than the {vocab_size} tokens of this run's "
                    "tokenizer: train it with the tokenizer it was trained with)")
        raise CheckpointError(f"{directory} holds {tensor.key} of shape {tuple(size)}, this "
                              f"run's model {tuple(tensor.global_shape)}{hint}; make the "
                              "config's model sections match the checkpoint")


def _megamoe_cause(err: BaseException):
    """The MegaMoEError inside DCP's CheckpointException (per-rank failures), if any."""
    return find_exception(err, MegaMoEError)


def find_exception(err: Optional[BaseException], kind: type, depth: int = 0):
    """The first `kind` exception in `err`, its causes and contexts, or the per-rank failures
    of DCP's CheckpointException (`failures`: rank -> (exception, traceback))."""
    if err is None or depth > 8:
        return None
    if isinstance(err, kind):
        return err
    for failure in (getattr(err, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        found = find_exception(inner if isinstance(inner, BaseException) else None, kind,
                               depth + 1)
        if found is not None:
            return found
    return find_exception(err.__cause__ or err.__context__, kind, depth + 1)
