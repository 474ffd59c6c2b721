"""Write a Megatron-Core torch_dist checkpoint part by part, with bounded memory.

A torch_dist checkpoint (megatron-core 0.16) is a PyTorch Distributed Checkpoint (DCP)
directory: `.metadata` (the pickled DCP `Metadata`: for every key its global shape, dtype and
chunk list, and where each chunk's bytes lie), `*.distcp` data files, plus Megatron's
`metadata.json` (backend name and version) and `common.pt` (the non-sharded state).

`dcp.save` needs the whole state dict at once. This writer instead drives DCP's own
`FileSystemWriter` one part (one layer) at a time: each part goes to its own `__<part>_0.distcp`
file, chunk data is produced lazily while the file is written (so only one chunk plus the part's
inputs is in memory), and the global `Metadata` is assembled from the chunk descriptions and
written once at the end. Readers (`dcp.load`, Megatron's `dist_checkpointing.load`) see an
ordinary DCP checkpoint.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Iterable

import torch
from torch.distributed.checkpoint import FileSystemWriter
# The file-name prefix of a plan's data files; Megatron's own async writer imports it too.
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from megamoe.checkpointing.sharded_keys import ObjectItem, TensorChunk
from megamoe.checkpointing.torch_files import require_finite

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


class _PartData:
    """What DCP's writer asks the planner for: each write item's data, produced on demand."""

    def __init__(self, tensors: dict[MetadataIndex, TensorChunk],
                 objects: dict[MetadataIndex, ObjectItem]):
        self.tensors = tensors
        self.objects = objects

    def resolve_data(self, item: WriteItem):
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.objects[item.index].data)
        chunk = self.tensors[item.index]
        tensor = chunk.make()
        if tuple(tensor.shape) != chunk.shape or tensor.dtype != chunk.dtype:
            raise AssertionError(f"{chunk.key}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"declared {chunk.shape} {chunk.dtype}")
        return require_finite(tensor, f"tensor {chunk.key} (from the input)").contiguous()


class StreamingCheckpointWriter:
    """Writes a torch_dist checkpoint into an existing empty directory, part by part."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._writer = FileSystemWriter(self.directory, single_file_per_rank=True,
                                        sync_files=True, thread_count=1)
        self._writer.set_up_storage_writer(is_coordinator=True)
        self._metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self._results = []
        self._parts = 0
        self.bytes_written = 0

    def write_part(self, tensors: Iterable[TensorChunk], objects: Iterable[ObjectItem] = ()) -> int:
        """Write one part's chunks and objects to a new data file; returns the bytes written."""
        tensor_items, object_items = {}, {}
        plan_items = []
        for chunk in tensors:
            index = MetadataIndex(chunk.key, torch.Size(chunk.offsets))
            properties = self._register_chunk(chunk)
            tensor_items[index] = chunk
            plan_items.append(WriteItem(index=index, type=WriteItemType.SHARD,
                                        tensor_data=TensorWriteData(
                                            chunk=ChunkStorageMetadata(torch.Size(chunk.offsets),
                                                                       torch.Size(chunk.shape)),
                                            properties=properties,
                                            size=torch.Size(chunk.global_shape))))
        for obj in objects:
            if obj.key in self._metadata:
                raise AssertionError(f"object {obj.key} written twice")
            self._metadata[obj.key] = BytesStorageMetadata()
            index = MetadataIndex(obj.key)
            object_items[index] = obj
            plan_items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        if not plan_items:
            return 0
        plan = SavePlan(plan_items, storage_data=_StoragePrefix(f"__{self._parts}_"))
        self._parts += 1
        results = self._writer.write_data(plan, _PartData(tensor_items, object_items)).value()
        self._results.append(results)
        written = sum(result.size_in_bytes for result in results)
        self.bytes_written += written
        return written

    def finish(self, common_state: dict) -> None:
        """Write the DCP `.metadata`, Megatron's `metadata.json` and `common.pt`."""
        for key, md in self._metadata.items():
            if isinstance(md, TensorStorageMetadata):
                _check_coverage(key, md)
        self._writer.finish(Metadata(state_dict_metadata=self._metadata), self._results)
        torch.save(common_state, self.directory / "common.pt")
        (self.directory / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))

    def _register_chunk(self, chunk: TensorChunk) -> TensorProperties:
        md = self._metadata.get(chunk.key)
        if md is None:
            md = TensorStorageMetadata(properties=TensorProperties(dtype=chunk.dtype),
                                       size=torch.Size(chunk.global_shape), chunks=[])
            self._metadata[chunk.key] = md
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != chunk.global_shape \
                or md.properties.dtype != chunk.dtype:
            raise AssertionError(f"{chunk.key}: chunk of {chunk.global_shape} {chunk.dtype} does "
                                 f"not match the tensor's {md}")
        md.chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.shape)))
        return md.properties


def _check_coverage(key: str, md: TensorStorageMetadata) -> None:
    """Every element of a global tensor must be written exactly once."""
    total = 1
    for size in md.size:
        total *= size
    written = 0
    for chunk in md.chunks:
        count = 1
        for size in chunk.sizes:
            count *= size
        written += count
    if written != total:
        raise AssertionError(f"{key}: chunks cover {written} of {total} elements")
