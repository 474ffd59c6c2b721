"""Checkpoints of a training run, as Megatron-Core distributed checkpoints (torch_dist).

Layout under the checkpoint folder (`checkpoint.dir`, default OUTPUT_DIR/checkpoints):

    iter_0000100/   one checkpoint: .metadata, *.distcp, common.pt, metadata.json
    latest          the name of the newest complete checkpoint, e.g. `iter_0000100`

A checkpoint holds the model's sharded state dict (Megatron-Core's keys; megamoe experts keyed by
global expert id, so any expert-parallel size loads them; the expert biases are buffers of the
routers), the optimizer state keyed like the parameters, each rank's RNG states, the step count,
the consumed samples (the data position), the learning-rate schedule and the whole config.
Every rank writes into `.iter_N.tmp`; only when all have finished is it renamed to `iter_N` and
`latest` rewritten (atomically), so a crash during a save leaves the previous checkpoint and
`latest` intact. RNG states are restored only at the parallel layout they were saved with (at
another layout each rank keeps its seeded state).

`init_from` loads only model weights, e.g. from tools/upcycle_ckpt.py (a Megatron-LM style root
with `latest_checkpointed_iteration.txt`) or a torch_dist folder.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megamoe.atomic import atomic_write_text
from megamoe.errors import CheckpointError
from megamoe.train.config import TrainConfig
from megamoe.train.model import sharded_state_metadata
from megamoe.train.progress import LATEST, TrainState, checkpoint_name, latest_checkpoint
from megamoe.train.schedule import LRSchedule

FORMAT_VERSION = 1
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
# Keys a model may ask for that an external checkpoint may lack: Megatron's empty linear-layer
# extra state, and expert biases (zeros are the right start for loss-free balancing).
_OPTIONAL_KEY_ENDINGS = ("_extra_state", "expert_bias")


def _layout() -> dict:
    return {"world_size": dist.get_world_size(),
            "tensor": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
            "expert": parallel_state.get_expert_model_parallel_world_size()}


def _rng_state() -> dict:
    """This rank's RNG states (torch CPU and CUDA, Megatron's tracked model-parallel states)."""
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_object(data: Any) -> ShardedObject:
    return ShardedObject("rng_state", data, (dist.get_world_size(),), (dist.get_rank(),),
                         replica_id=0)


def _model_sharded(model: torch.nn.Module, config: TrainConfig) -> dict:
    return model.sharded_state_dict(metadata=sharded_state_metadata(config))


def save_checkpoint(ckpt_dir: str | Path, state: TrainState, model: torch.nn.Module, engine,
                    config: TrainConfig) -> Path:
    """Save the run at `state` (on every rank); returns the checkpoint folder.

    Saving a step that already has a checkpoint does nothing.
    """
    ckpt_dir = Path(ckpt_dir)
    name = checkpoint_name(state.iteration)
    final, tmp = ckpt_dir / name, ckpt_dir / f".{name}.tmp"
    if final.is_dir():
        return final
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sharded = _model_sharded(model, config)
    sharded = {
        "model": model_sharded,
        "optimizer": engine.optimizer_sharded_state_dict(model_sharded, is_loading=False),
        "rng_state": _rng_object(_rng_state()),
        "train_state": dataclasses.asdict(state),
        "lr_schedule": dataclasses.asdict(LRSchedule.from_config(config.optimizer,
                                                                 config.training.train_steps)),
        "config": config.to_dict(),
        "layout": _layout(),
        "format_version": FORMAT_VERSION,
    }
    dist_checkpointing.save(sharded, str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp.rename(final)
        atomic_write_text(ckpt_dir / LATEST, name + "\n")
        _prune(ckpt_dir, config.checkpoint.keep_last)
    dist.barrier()
    return final


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all)."""
    if keep_last <= 0:
        return
    saved = sorted(p for p in ckpt_dir.glob("iter_*") if p.is_dir())
    for old in saved[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _check_compatible(saved: dict, config: TrainConfig, path: Path) -> None:
    """The model architecture must match; parallel sizes, data and schedule may change."""
    current = config.to_dict()
    for section in ("model", "moe"):
        for key in sorted(set(saved[section]) | set(current[section])):
            old, new = saved[section].get(key), current[section].get(key)
            if old != new:
                raise CheckpointError(
                    f"checkpoint {path} was trained with {section}.{key}={old!r} but the config "
                    f"says {new!r}; use the checkpoint's model settings or a new checkpoint.dir"
                )


def load_checkpoint(path: Path, model: torch.nn.Module, engine, config: TrainConfig) -> TrainState:
    """Restore model, optimizer, RNG states (same layout only) and the run's position."""
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except (OSError, CheckpointingException, RuntimeError) as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {_first_line(err)}") from None
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a megamoe training checkpoint (format "
                              f"{common.get('format_version')!r}); use checkpoint.init_from for "
                              "model weights from elsewhere")
    _check_compatible(common["config"], config, path)
    same_layout = common["layout"] == _layout()
    model_sharded = _model_sharded(model, config)
    request = {"model": model_sharded,
               "optimizer": engine.optimizer_sharded_state_dict(model_sharded, is_loading=True)}
    if same_layout:
        request["rng_state"] = _rng_object(None)
    loaded = _load(request, path)
    model.load_state_dict(loaded["model"])
    engine.load_optimizer_state_dict(loaded["optimizer"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return TrainState(**common["train_state"])


def _load(request: dict, path: Path, strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED):
    try:
        return dist_checkpointing.load(request, str(path), strict=strict)
    except CheckpointingException as err:
        raise CheckpointError(f"cannot load {path}: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def resolve_weights_dir(path: str | Path) -> Path:
    """The torch_dist folder of `path`: a Megatron-LM root (`latest_checkpointed_iteration.txt`,
    as tools/upcycle_ckpt.py writes), a megamoe checkpoint folder (`latest`), or the folder."""
    path = Path(path).expanduser()
    tracker = path / MEGATRON_LM_TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        path = path / ("release" if text == "release" else f"iter_{int(text):07d}")
    elif (path / LATEST).is_file():
        path = latest_checkpoint(path)
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"no torch_dist checkpoint at {path} (metadata.json missing); pass "
                              f"a checkpoint folder or a root with {MEGATRON_LM_TRACKER}")
    return path


def load_model_weights(path: str | Path, model: torch.nn.Module, config: TrainConfig) -> Path:
    """Initialise `model` from the model weights of the checkpoint at `path` (see
    `resolve_weights_dir`); keys it lacks may only be extra state and expert biases."""
    folder = resolve_weights_dir(path)
    loaded, _, absent = _load({"model": _model_sharded(model, config)}, folder,
                              strict=StrictHandling.RETURN_ALL)
    required = sorted(k for k in absent if not k.endswith(_OPTIONAL_KEY_ENDINGS))
    if required:
        raise CheckpointError(
            f"{folder} lacks {len(required)} model tensors, e.g. {required[:3]}; make the "
            "config's model and moe sections match the checkpoint"
        )
    missing, _ = model.load_state_dict(loaded["model"], strict=False)
    required = [k for k in missing if not k.endswith(_OPTIONAL_KEY_ENDINGS)]
    if required:
        raise CheckpointError(f"{folder} did not provide {required[:3]}; make the config's model "
                              "and moe sections match the checkpoint")
    return folder
