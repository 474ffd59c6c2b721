"""Checksums of every file of a checkpoint folder, written last, verified before loading.

`megamoe_manifest.json` lists each file under the folder (relative path, size, CRC-32 of its
bytes, read in 4 MiB chunks) except itself. It is written after every rank has finished
writing and before the folder is renamed into place, so a folder with a manifest is complete
by construction; `verify_folder` then reports the first file that is missing, unlisted,
truncated or changed. With `collective=True` (every rank of the default process group calls
together, as a training run does) the files are split over the ranks (each checks every
world-size-th file) and the results gathered, so every rank returns the same answer; otherwise
one process does all the work (the upcycler, which may run on one rank of a larger job).
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megamoe.atomic import atomic_write_text
from megamoe.bounded import read_json
from megamoe.errors import CheckpointError
from megamoe.paths import inside

MANIFEST_FILE = "megamoe_manifest.json"
MANIFEST_FORMAT = "megamoe-checkpoint-manifest/1"
CHUNK_BYTES = 4 << 20
MAX_MANIFEST_BYTES = 64 << 20  # ~800,000 files: far beyond any checkpoint's count


def file_crc32(path: str | os.PathLike) -> str:
    """CRC-32 of the file's bytes as 8 hex digits, streamed."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST_FILE)


def _my_share(items: list[str], collective: bool) -> list[str]:
    return items[dist.get_rank()::dist.get_world_size()] if collective else items


def _gather(part, collective: bool):
    if not collective or dist.get_world_size() == 1:
        return [part]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts


def write_manifest(folder: str | os.PathLike, collective: bool = False) -> None:
    """Checksum every file in `folder` and write the manifest (on rank 0 when `collective`)."""
    folder = Path(folder)
    mine = {name: {"size": (folder / name).stat().st_size, "crc32": file_crc32(folder / name)}
            for name in _my_share(_files(folder), collective)}
    files = {name: entry for part in _gather(mine, collective) for name, entry in part.items()}
    if not collective or dist.get_rank() == 0:
        atomic_write_text(folder / MANIFEST_FILE, json.dumps(
            {"format": MANIFEST_FORMAT, "algorithm": "crc32", "files": dict(sorted(files.items()))},
            indent=1) + "\n")


def has_manifest(folder: str | os.PathLike) -> bool:
    """Whether `folder` has a manifest (anything by that name: one that is not a regular file
    is then refused by `verify_folder`, not taken for none)."""
    return os.path.lexists(Path(folder) / MANIFEST_FILE)


def read_manifest(folder: str | os.PathLike) -> dict[str, dict]:
    """The manifest's files (name -> size, crc32); a malformed manifest, or one larger than
    MAX_MANIFEST_BYTES, raises CheckpointError."""
    path = Path(folder) / MANIFEST_FILE
    data = read_json(path, MAX_MANIFEST_BYTES, CheckpointError)
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path} is not a {MANIFEST_FORMAT} manifest")
    files = data.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and isinstance(e, dict) and isinstance(e.get("size"), int)
            and isinstance(e.get("crc32"), str) for name, e in files.items()):
        raise CheckpointError(f"{path} has a malformed file list")
    return files


def _check(folder: Path, name: str, entry: dict) -> Optional[str]:
    try:
        path = inside(folder, name)
    except CheckpointError as err:
        return str(err)
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or changed)"
    if file_crc32(path) != entry["crc32"]:
        return f"{path} does not match its checksum in {MANIFEST_FILE} (corrupt)"
    return None


def verify_folder(folder: str | os.PathLike, collective: bool = False) -> Optional[str]:
    """None if every file of `folder` matches its manifest, else one line naming the first
    bad file. A folder without a manifest raises FileNotFoundError (the caller decides)."""
    folder = Path(folder)
    if not has_manifest(folder):
        raise FileNotFoundError(folder / MANIFEST_FILE)
    try:
        files = read_manifest(folder)
    except CheckpointError as err:
        return f"{err}"
    links = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_symlink())
    if links:
        return f"{folder / links[0]} is a link; a checkpoint holds plain files only"
    unlisted = sorted(set(_files(folder)) - set(files))
    if unlisted:
        return f"{folder / unlisted[0]} is not listed in {MANIFEST_FILE} (added after saving)"
    mine = [p for p in (_check(folder, name, files[name]) for name in _my_share(sorted(files), collective))
            if p is not None]
    problems = [p for part in _gather(mine, collective) for p in part]
    return problems[0] if problems else None
