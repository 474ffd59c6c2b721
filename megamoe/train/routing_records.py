"""Routing records of `megamoe.train` (routing replay, R3, arXiv 2510.11370;
`megamoe.routing.replay`): `training.routing_record: DIR` writes every step's routing, and
`training.routing_replay: DIR` trains with the routing of such a record instead of the routers'
own choices (an inference engine's, say, written in this layout).

Layout: DIR/step_{s:07d}/microbatch_{g:05d}.stage_{p:03d}.safetensors holds the MoE layers of
pipeline stage p for global micro-batch g of step s (g = local micro-batch x data-parallel size
+ data-parallel rank: the order in which the step's samples reach the ranks). Each layer n
(global, 1-based) is one int32 tensor `layer_{n}` [S*B, K]: the top-k expert ids of every token
of the micro-batch, rows in [S, B] order (sequence first), gathered over the tensor-parallel
group. A record is thus the same at every layout it is written at, and any layout replays it.
Tensor-parallel rank 0 writes each file at the end of the step, to a temporary name first.
Records are untrusted input: a missing file, a layer the model does not have (or lacks), a
shape other than [S*B, K] or an expert id out of range is a one-line DataError.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megamoe.balancing import routers_of
from megamoe.errors import ConfigError, DataError
from megamoe.paths import inside
from megamoe.routing.replay import checked_replay_indices

LAYER_NAME = re.compile(r"layer_(\d{1,6})")
MAX_RECORD_BYTES = 1 << 30
"""A record file larger than this (1 GiB) is refused unread."""


def step_folder(folder: Path, step: int) -> Path:
    return inside(folder, f"step_{step:07d}")


def record_name(microbatch: int, stage: int) -> str:
    return f"microbatch_{microbatch:05d}.stage_{stage:03d}.safetensors"


class RoutingRecords:
    """Records or replays the routing of this rank's model chunks, one micro-batch at a time
    (`before_forward` / `after_forward` around each chunk's forward, `end_step` after the
    step's backward passes). `chunks`: this rank's model chunks; `replay`: read `folder`
    (else write it); `tokens`: S*B of a micro-batch."""

    def __init__(self, chunks: list[torch.nn.Module], folder: str, replay: bool, tokens: int):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.folder, self.replay, self.tokens = Path(folder), replay, tokens
        self.routers = [[m for m in chunk.modules() if getattr(m, "replay", None) is not None]
                        for chunk in chunks]
        setting = "training.routing_replay" if replay else "training.routing_record"
        if sum(map(len, self.routers)) != len(routers_of(chunks)):
            raise ConfigError(f"{setting}={folder} needs every MoE layer's router to record and "
                              "replay; set moe.router.replay=true (a top-k router)")
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        device = next(chunks[0].parameters()).device
        self.model_layers = self._model_layers(
            parallel_state.get_pipeline_model_parallel_group(), device)
        if not self.model_layers:
            raise ConfigError(f"{setting}={folder}: the model has no MoE layer to record or "
                              "replay; drop the setting")
        action = RouterReplayAction.REPLAY_FORWARD if replay else RouterReplayAction.RECORD
        self.action = action
        self._set_action(action)
        self.step = 0
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.loaded: dict[int, dict[int, torch.Tensor]] = {}

    def _model_layers(self, pp_group, device: torch.device) -> set[int]:
        """The global numbers of every MoE layer of the model, all pipeline stages' (gathered
        as tensors padded with -1 to the longest stage's count)."""
        numbers = [r.layer_number for routers in self.routers for r in routers]
        count = torch.tensor([len(numbers)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=pp_group)
        own = torch.full((int(count),), -1, dtype=torch.long, device=device)
        own[:len(numbers)] = torch.tensor(numbers, dtype=torch.long)
        parts = [torch.empty_like(own) for _ in range(dist.get_world_size(pp_group))]
        dist.all_gather(parts, own, group=pp_group)
        return {int(n) for part in parts for n in part.tolist() if n >= 0}

    def _set_action(self, action) -> None:
        for routers in self.routers:
            for router in routers:
                router.replay.set_router_replay_action(action)

    def start_step(self, step: int) -> None:
        self.step, self.pending, self.loaded = step, {}, {}
        for routers in self.routers:
            for router in routers:
                router.replay.clear_indices()

    def before_forward(self, chunk: int, microbatch: int) -> None:
        """Replay: give the chunk's routers this micro-batch's experts (this rank's rows)."""
        if not self.replay:
            return
        layers = self._read(microbatch)
        rows = self.tokens // self.tp_size
        for router in self.routers[chunk]:
            own = layers[router.layer_number][self.tp_rank * rows:(self.tp_rank + 1) * rows]
            router.replay.set_target_indices(own)

    def after_forward(self, chunk: int, microbatch: int) -> None:
        """Record: keep the chunk's routers' choices of this micro-batch (all tokens of the
        tensor-parallel group)."""
        if self.replay:
            return
        record = self.pending.setdefault(microbatch, {})
        for router in self.routers[chunk]:
            indices = router.replay.get_recorded_indices().to(torch.int32)
            if self.tp_size > 1:
                parts = [torch.empty_like(indices) for _ in range(self.tp_size)]
                dist.all_gather(parts, indices.contiguous(), group=self.tp_group)
                indices = torch.cat(parts)
            record[f"layer_{router.layer_number}"] = indices.cpu()

    def end_step(self) -> None:
        """Record: write this step's files (tensor-parallel rank 0)."""
        if self.replay or self.tp_rank != 0:
            return
        folder = step_folder(self.folder, self.step)
        folder.mkdir(parents=True, exist_ok=True)
        for microbatch, tensors in self.pending.items():
            path = inside(folder, record_name(microbatch, self.stage))
            partial = path.with_name(f".{path.name}.partial")
            save_file(tensors, str(partial))
            os.replace(partial, path)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The routers route by themselves (held-out evaluation), then record or replay
        again."""
        self._set_action(None)
        try:
            yield
        finally:
            self._set_action(self.action)

    def _read(self, microbatch: int) -> dict[int, torch.Tensor]:
        """Every layer of global micro-batch `microbatch` of this step, from all stages'
        files, checked against the model."""
        if microbatch in self.loaded:
            return self.loaded[microbatch]
        folder = step_folder(self.folder, self.step)
        pattern = re.compile(rf"microbatch_{microbatch:05d}\.stage_\d{{3}}\.safetensors")
        names = sorted(n for n in (os.listdir(folder) if folder.is_dir() else ())
                       if pattern.fullmatch(n))
        if not names:
            raise DataError(f"{folder}: no routing record of micro-batch {microbatch} "
                            f"({record_name(microbatch, 0)}); replay a record of at least "
                            f"{self.step} steps of this run's batch size")
        layers: dict[int, torch.Tensor] = {}
        for name in names:
            layers.update(self._read_file(inside(folder, name)))
        if set(layers) != self.model_layers:
            raise DataError(f"{folder}: micro-batch {microbatch} records MoE layers "
                            f"{sorted(layers)} but the model's are {sorted(self.model_layers)}; "
                            "replay a record of this model")
        self.loaded[microbatch] = layers
        return layers

    def _read_file(self, path: Path) -> dict[int, torch.Tensor]:
        if not path.is_file() or path.stat().st_size > MAX_RECORD_BYTES:
            raise DataError(f"{path}: not a routing record file (not a regular file, or over "
                            f"{MAX_RECORD_BYTES >> 20} MiB)")
        experts = {r.layer_number: (r.cfg.num_experts, r.cfg.topk)
                   for routers in self.routers for r in routers}
        layers = {}
        try:
            with safe_open(str(path), "pt") as f:
                for name in f.keys():
                    match = LAYER_NAME.fullmatch(name)
                    if match is None:
                        raise DataError(f"{path}: tensor {name[:80]!r} is not a layer_N of a "
                                        "routing record")
                    layer = int(match.group(1))
                    indices = f.get_tensor(name)
                    if layer in experts:
                        num_experts, topk = experts[layer]
                        try:
                            indices = checked_replay_indices(indices, self.tokens,
                                                             num_experts, topk, layer)
                        except DataError as err:
                            raise DataError(f"{path}: {err}") from None
                    layers[layer] = indices
        except SafetensorError as err:
            raise DataError(f"{path}: not a readable safetensors routing record "
                            f"({str(err)[:120]})") from None
        return layers
