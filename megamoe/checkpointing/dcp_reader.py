"""Random access to one tensor, or one slice of it, in a PyTorch Distributed Checkpoint.

`dcp.load` fills a whole state dict; an upcycler streaming layer by layer wants one layer's slice
of a stacked `[L, ...]` tensor at a time. This reader asks DCP's own `FileSystemReader` for the
saved chunks overlapping the requested region (DCP's resharding logic) and copies them into a
tensor of just that region, so memory holds one slice (plus the saved chunk being copied).
`.metadata` and sharded objects are unpickled only through megamoe.checkpointing's allow-lists.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megamoe.checkpointing.safe_dcp import METADATA_FILE, SafeFileSystemReader, read_dcp_metadata
from megamoe.checkpointing.torch_files import first_line
from megamoe.errors import CheckpointError


class _Target:
    """What DCP's reader asks the planner for: where each read item's data goes."""

    def __init__(self, tensor: Optional[torch.Tensor] = None):
        self.tensor = tensor
        self.data: Optional[bytes] = None
        self.elements = 0

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        view = self.tensor
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, start, length)
        self.elements += view.numel()
        return view

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """The reader copied the data into the view from `resolve_tensor`: nothing to stage."""

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.data = value.getvalue()


class DCPReader:
    """Tensors and sharded objects of a DCP checkpoint directory, read one at a time."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._reader = SafeFileSystemReader(self.directory)
        self.metadata = read_dcp_metadata(self.directory / METADATA_FILE)
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def tensors(self) -> dict[str, TensorStorageMetadata]:
        """Every tensor key with its global shape, dtype and saved chunks."""
        return {key: md for key, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)}

    def objects(self) -> list[str]:
        """Every sharded-object key."""
        return [key for key, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, BytesStorageMetadata)]

    def read(self, key: str, offsets: Optional[Sequence[int]] = None,
             shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The region [offsets, offsets + shape) of global tensor `key` (all of it by default)."""
        md = self.metadata.state_dict_metadata[key]
        offsets = tuple(offsets) if offsets is not None else (0,) * len(md.size)
        shape = tuple(shape) if shape is not None else tuple(md.size)
        target = _Target(torch.empty(shape, dtype=md.properties.dtype))
        request = ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape))
        self._run(create_read_items_for_chunk_list(key, md, [request]), target, key)
        if target.elements != target.tensor.numel():
            raise CheckpointError(f"{self.directory}: the saved chunks of {key} cover "
                                  f"{target.elements} of the {target.tensor.numel()} elements "
                                  f"requested at {offsets}; the checkpoint is incomplete")
        return target.tensor

    def read_object(self, key: str) -> bytes:
        """The serialized bytes of sharded object `key` (checked to load weights_only)."""
        target = _Target()
        zero = torch.Size([0])
        item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                        dest_offsets=zero, storage_index=MetadataIndex(key),
                        storage_offsets=zero, lengths=zero)
        self._run([item], target, key)
        return target.data

    def _run(self, items: list[ReadItem], target: _Target, key: str) -> None:
        try:
            self._reader.read_data(LoadPlan(items), target).wait()
        except CheckpointError:
            raise
        except FileNotFoundError as err:
            raise CheckpointError(f"{self.directory}: data file {Path(err.filename).name} of "
                                  f"{key} is missing; the checkpoint is incomplete") from None
        except Exception as err:  # noqa: BLE001 - corrupt input fails in many ways: one line
            raise CheckpointError(f"{self.directory}: cannot read {key} ({first_line(err)}); "
                                  "the checkpoint is corrupt") from None
