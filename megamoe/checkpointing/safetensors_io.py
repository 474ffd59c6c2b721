"""Hugging Face safetensors checkpoints: a checked, tensor-at-a-time reader and a streaming
sharded writer.

Reader: `model.safetensors`, or shards named by `model.safetensors.index.json` (`weight_map`:
tensor name -> shard file). Every shard's header is read up front, so a missing shard, an index
naming a tensor its shard lacks, or a dtype megamoe cannot train (quantised int/fp8 weights, unless
the caller accepts a release's packed dtypes: megamoe.checkpointing.quantized) is reported in one
line before anything is written. Tensors are then read one at a time
(memory-mapped by safetensors), never a whole shard.

Writer: tensors are added one at a time and flushed to a new shard whenever the pending bytes
reach `max_shard_bytes`, so memory holds at most one shard; `finish()` names the shards
`model-0000i-of-0000n.safetensors` and writes the index, as `save_pretrained` does.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megamoe.bounded import read_json
from megamoe.checkpointing.torch_files import require_finite
from megamoe.errors import CheckpointError
from megamoe.paths import inside

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20
"""An index file larger than this (64 MiB, about 500,000 tensors) is refused unread."""
FLOAT_DTYPES = ("F32", "BF16", "F16")


class SafetensorsReader:
    """Every tensor of a (sharded) safetensors checkpoint, by name, read on demand."""

    def __init__(self, directory: Path, packed_dtypes: tuple[str, ...] = ()):
        """`packed_dtypes`: safetensors dtypes accepted beside FLOAT_DTYPES (a quantised
        release's float8 weights or uint8 blocks, which megamoe.checkpointing.quantized
        dequantises); any other dtype is refused."""
        self.directory = directory
        self.accepted = FLOAT_DTYPES + tuple(packed_dtypes)
        self.shard_of = self._weight_map()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        """Tensor name -> its safetensors dtype ("F32", "BF16", "F8_E4M3", "U8", ...)."""
        for shard in sorted(set(self.shard_of.values())):
            self._check_shard(shard)
        unlisted = sorted(set(self.shard_of) - set(self.shapes))
        if unlisted:
            raise CheckpointError(f"{directory / INDEX_FILE} maps {unlisted[0]} to "
                                  f"{self.shard_of[unlisted[0]]}, which does not hold it "
                                  f"({len(unlisted)} such tensors); the index does not match "
                                  "the shards")

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            data = read_json(inside(self.directory, INDEX_FILE), MAX_INDEX_BYTES,
                             CheckpointError)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index} has no valid weight_map; restore the index "
                                      "file")
            for shard in set(weight_map.values()):
                inside(self.directory, shard)  # a shard named outside the folder is refused
            return weight_map
        single = self.directory / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"{self.directory} has neither {INDEX_FILE} nor {SINGLE_FILE}; "
                                  "pass a Hugging Face model saved with safetensors")
        with self._open(SINGLE_FILE) as handle:
            return {name: SINGLE_FILE for name in handle.keys()}

    def _open(self, shard: str):
        path = inside(self.directory, shard)
        if not path.is_file():
            raise CheckpointError(f"shard {path} is missing; the checkpoint is incomplete "
                                  "(download every shard the index names)")
        try:
            return safe_open(str(path), framework="pt")
        except Exception as err:  # noqa: BLE001 - a corrupt header fails in many ways: one line
            raise CheckpointError(f"shard {path} is not a readable safetensors file "
                                  f"({str(err).splitlines()[0] if str(err) else err!r})") from None

    def _check_shard(self, shard: str) -> None:
        with self._open(shard) as handle:
            for name in handle.keys():
                if self.shard_of.get(name) != shard:
                    continue
                piece = handle.get_slice(name)
                dtype = piece.get_dtype()
                if dtype not in self.accepted:
                    raise CheckpointError(
                        f"{self.directory / shard}: tensor {name} has dtype {dtype}; only "
                        f"{'/'.join(self.accepted)} weights convert here (config.json's "
                        "quantization_config names the formats dequantised: fp8 block scales, "
                        "mxfp4; dequantise other models first)")
                self.shapes[name] = tuple(piece.get_shape())
                self.dtypes[name] = dtype

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self) -> list[str]:
        return list(self.shapes)

    def read(self, name: str) -> torch.Tensor:
        """One tensor, as saved (a float one refused if it holds NaN/Inf)."""
        if name not in self.shapes:
            raise CheckpointError(f"{self.directory} lacks tensor {name}; the checkpoint is "
                                  "incomplete or of another architecture")
        with self._open(self.shard_of[name]) as handle:
            tensor = handle.get_tensor(name)
        if self.dtypes[name] not in FLOAT_DTYPES:
            return tensor  # packed: checked once dequantised
        return require_finite(tensor, f"{self.directory / self.shard_of[name]}: tensor {name}")


class ShardedSafetensorsWriter:
    """Write tensors into size-bounded safetensors shards plus their index (see the module
    docstring)."""

    def __init__(self, directory: Path, max_shard_bytes: int = 2 * 2**30):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._pending[name] = require_finite(tensor, f"tensor {name} (exported)").contiguous()
        size = tensor.numel() * tensor.element_size()
        self._pending_bytes += size
        self.total_bytes += size
        if self._pending_bytes >= self.max_shard_bytes:
            self._flush()

    def add_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._pending:
            return
        save_file(self._pending, str(self._temp_name(len(self._shards))),
                  metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def _temp_name(self, index: int) -> Path:
        return self.directory / f".shard-{index:05d}.safetensors"

    def finish(self, metadata: Optional[dict] = None) -> list[str]:
        """Flush, name the shards as `save_pretrained` does and write the index; returns the
        shard file names."""
        self._flush()
        count = len(self._shards)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for index, (name, keys) in enumerate(zip(names, self._shards)):
            self._temp_name(index).rename(self.directory / name)
            weight_map.update({key: name for key in keys})
        index = {"metadata": {"total_size": self.total_bytes, **(metadata or {})},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names
