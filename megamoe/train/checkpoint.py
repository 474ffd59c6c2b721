"""Checkpoints of a training run, as Megatron-Core distributed checkpoints (torch_dist), in
Megatron-LM's save-directory convention.

Layout under the checkpoint folder (`checkpoint.dir`, default OUTPUT_DIR/checkpoints):

    iter_0000100/                      one checkpoint: .metadata, *.distcp, metadata.json,
                                       common.pt (megatron-core <= 0.18; from 0.19 the common
                                       state is inside the .distcp files),
                                       megamoe_manifest.json (checksums)
    latest_checkpointed_iteration.txt  the iteration of the newest complete checkpoint, `100`

A checkpoint holds the model's sharded state dict under `model` (Megatron-Core's keys; megamoe
experts keyed by global expert id, so any expert-parallel size loads them; the expert biases are
buffers of the routers), the optimizer state keyed like the parameters, each rank's RNG states,
and as common state Megatron-LM's keys (`args`, `checkpoint_version`, `iteration`,
`opt_param_scheduler`, ...: see megatron_lm_state) plus megamoe's (`train_state`, `config`,
`layout`, `lr_schedule`, `format_version`: the versioned schema of checkpoint_schema). So
Megatron-LM's `pretrain_gpt.py --load` with megamoe's spec continues it, and a Megatron-LM
checkpoint of a megamoe model resumes here (weights and position; the optimizer starts fresh,
since Megatron-LM's layout differs).

Every rank writes into `.iter_N.tmp`; when all have finished, the files are checksummed into the
manifest, the folder renamed to `iter_N` and the tracker rewritten (atomically), so a crash or a
full disk during a save leaves the previous checkpoint and the tracker intact. An `iter_N` already
there is left from an abandoned trajectory (the tracker was set back to rewind the run, as with
Megatron-LM): the run resumes from the tracker's step and replaces that folder when it saves
step N again, saying so. A checkpoint's recorded step must be its folder's. Loading verifies
every file against the manifest before any tensor is used (a checkpoint without one, from
Megatron-LM or an older megamoe, loads with a warning), and every pickle is restricted to an
allow-list (megamoe.checkpointing). Resuming never moves to another checkpoint on its own;
`checkpoint.resume_from_verified=true` resumes from the newest one that verifies. `keep_last`
pruning keeps the newest verified checkpoint from before the run started. RNG states are
restored only at the parallel layout they were saved with (at another layout each rank keeps its
seeded state). A tensor-parallel size that pads the vocabulary to another row count loads the
embedding and output layer, and their optimizer states, with the real rows bit for bit, padding
rows added (zeros) or dropped (megamoe.checkpointing.safe_dcp `_check_global_shapes`).

`init_from` loads only model weights, e.g. from tools/upcycle_ckpt.py (a Megatron-LM style root
with `latest_checkpointed_iteration.txt`) or a torch_dist folder, into a model of the shapes the
checkpoint records (checkpoint_shapes names a setting that differs).

A resumed run may change the training settings of its model (checkpoint_schema: a coefficient,
a rate, the dispatcher, dropout) but no model setting; `check_start` refuses the latter before
anything is built and returns the former, which the loop announces and records once.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megamoe.checkpointing.layout import (TrainState, check_folder_step, checkpoint_name,
                                          iteration_of, latest_checkpoint, resolve_weights_dir,
                                          saved_checkpoints, step_of, tracked_step,
                                          write_tracker)
from megamoe.checkpointing.manifest import has_manifest, verify_folder, write_manifest
from megamoe.checkpointing.no_orphans import own_write_results_queue
from megamoe.checkpointing.safe_dcp import (FAILURES, METADATA_FILE, common_state_problem,
                                            find_exception, load_common_state,
                                            load_dist_checkpoint, read_dcp_metadata)
from megamoe.checkpointing.torch_files import first_line
from megamoe.errors import CheckpointError, MegaMoEError
from megamoe.megatron import compat
from megamoe.train.checkpoint_schema import (FORMAT_VERSION, TOKENIZER_KEY, SettingChange,
                                             check_compatible, is_megamoe_state,
                                             optimizer_changes, saved_position,
                                             training_changes, upgraded)
from megamoe.train.checkpoint_shapes import check_weights_fit, recorded_sections
from megamoe.train.checkpoint_tokenizer import (check_checkpoint_tokenizer, tokenizer_record,
                                                write_checkpoint_files)
from megamoe.train.config import TrainConfig
from megamoe.train.guards import DivergenceError, describe_module, first_nonfinite_parameter
from megamoe.train.megatron_lm_state import (check_megatron_lm_args, is_megatron_lm_checkpoint,
                                             megatron_lm_common, train_state_of)
from megamoe.train.model import sharded_state_metadata
from megamoe.train.schedule import LRSchedule
from megamoe.train.settings.optimizer import check_resumed_optimizer

# Files every torch_dist checkpoint has; the common state is `common.pt` (megatron-core <= 0.18)
# or a sharded object inside the `.distcp` files (>= 0.19), see `common_state_problem`.
DCP_FILES = ("metadata.json", METADATA_FILE)
# Keys a model may ask for that an external checkpoint may lack: Megatron's empty linear-layer
# extra state, and expert biases (zeros are the right start for loss-free balancing).
_OPTIONAL_KEY_ENDINGS = ("_extra_state", "expert_bias")
# The newest checkpoint that verified before this process saved anything, per checkpoint folder
# (the one `keep_last` never prunes); filled by `resume_checkpoint` or the first save.
_PRE_RUN_VERIFIED: dict[Path, Optional[Path]] = {}
# Folders this process has verified (or warned about), so resuming reads each file once.
_CHECKED: set[Path] = set()


def _distributed() -> bool:
    """Whether every rank of a run takes part (checkpoints are saved and checked together)."""
    return dist.is_available() and dist.is_initialized()


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _warn(message: str) -> None:
    if _rank0():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _layout() -> dict:
    return {"world_size": dist.get_world_size(),
            "tensor": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
            "virtual": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
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


def _chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model chunks (one per virtual pipeline stage) of the loop's model."""
    return list(model) if isinstance(model, torch.nn.ModuleList) else [model]


def _model_entries(model: torch.nn.Module, config: TrainConfig) -> dict:
    """The model's sharded state dicts under Megatron-LM's state-dict entries: `model`, or
    `model0`, `model1`, ... with virtual pipeline stages. The entries' tensors are keyed by
    global layer and expert, so any layout loads them whatever the entry names."""
    chunks = _chunks(model)
    metadata = sharded_state_metadata(config)
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=metadata)}
    return {f"model{i}": chunk.sharded_state_dict(metadata=metadata)
            for i, chunk in enumerate(chunks)}


def _load_model_entries(model: torch.nn.Module, loaded: dict, strict: bool = True) -> list[str]:
    """Load `_model_entries`' loaded counterpart into the chunks; returns the missing keys."""
    chunks = _chunks(model)
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    missing = []
    for name, chunk in zip(names, chunks):
        missing += chunk.load_state_dict(loaded[name], strict=strict).missing_keys
    return missing


# ---- verification ---------------------------------------------------------------------------

def checkpoint_problem(folder: Path) -> Optional[str]:
    """None if `folder` is a complete torch_dist checkpoint whose files match its manifest (or
    has no manifest, see `require_verified`), else one line naming the first bad file."""
    if not folder.is_dir():
        return f"{folder} does not exist"
    for name in DCP_FILES:
        if not (folder / name).is_file():
            return f"{folder / name} is missing"
    if has_manifest(folder):
        problem = verify_folder(folder, collective=_distributed())
        if problem is not None:
            return problem
    return common_state_problem(folder)


def newest_verified(ckpt_dir: Path, skip: Optional[Path] = None,
                    at_most: Optional[int] = None) -> Optional[Path]:
    """The newest checkpoint in `ckpt_dir` with a manifest that verifies (other than `skip`),
    of step `at_most` or earlier when given (the tracker's: newer folders are left from an
    abandoned trajectory)."""
    for folder in reversed(saved_checkpoints(ckpt_dir)):
        if folder != skip and (at_most is None or iteration_of(folder) <= at_most) and \
                has_manifest(folder) and checkpoint_problem(folder) is None:
            return folder
    return None


def require_verified(folder: Path, ckpt_dir: Optional[Path] = None) -> None:
    """Raise a one-line CheckpointError unless `folder` verifies; warn once if it has no
    manifest. The error names the newest checkpoint in `ckpt_dir` that does verify."""
    if folder in _CHECKED:
        return
    problem = checkpoint_problem(folder)
    if problem is not None:
        fallback = (newest_verified(ckpt_dir, skip=folder, at_most=step_of(folder))
                    if ckpt_dir is not None else None)
        hint = (f"the newest checkpoint that verifies is {fallback} (set "
                "checkpoint.resume_from_verified=true to resume from it)" if fallback else
                "no other checkpoint there verifies" if ckpt_dir is not None else
                "restore the checkpoint or use another one")
        raise CheckpointError(f"checkpoint {folder} is unusable: {problem}; {hint}")
    if not has_manifest(folder):
        _warn(f"{folder} has no megamoe_manifest.json (made by Megatron-LM or an older "
              "megamoe); its files cannot be verified before loading")
    _CHECKED.add(folder)


def resume_checkpoint(config: TrainConfig) -> Optional[Path]:
    """The verified checkpoint this run resumes from (the tracker's), or None for a new run.

    A tracker naming nothing, or a checkpoint that does not verify, is an error naming the
    newest checkpoint that does (no newer than the tracker's step); with
    `checkpoint.resume_from_verified` that one is used. Folders newer than the checkpoint
    resumed from (a tracker set back to rewind the run) are named in a warning: `save_checkpoint`
    replaces each when the run reaches its step.
    """
    ckpt_dir = config.checkpoint_dir
    tracked = tracked_step(ckpt_dir)
    try:
        latest = latest_checkpoint(ckpt_dir)
        if latest is not None:
            require_verified(latest, ckpt_dir)
    except CheckpointError as err:
        fallback = (newest_verified(ckpt_dir, at_most=tracked)
                    if config.checkpoint.resume_from_verified else None)
        if fallback is None:
            raise
        _warn(f"{err}; resuming from {fallback} (checkpoint.resume_from_verified=true)")
        latest = fallback
    if ckpt_dir not in _PRE_RUN_VERIFIED:
        _PRE_RUN_VERIFIED[ckpt_dir] = (latest if latest is not None and has_manifest(latest)
                                       else newest_verified(ckpt_dir, at_most=tracked))
    _warn_abandoned(ckpt_dir, latest)
    return latest


def _warn_abandoned(ckpt_dir: Path, resumed: Optional[Path]) -> None:
    """Name the checkpoint folders newer than the one resumed from (all of them for a fresh
    start): they are left from an abandoned trajectory and will be replaced."""
    start = iteration_of(resumed) if resumed is not None else 0
    newer = [folder.name for folder in saved_checkpoints(ckpt_dir)
             if iteration_of(folder) > start]
    if newer:
        since = f"the resumed {resumed.name}" if resumed is not None else "a fresh start"
        _warn(f"{ckpt_dir} holds {len(newer)} checkpoint(s) newer than {since} ({newer[0]}"
              f"{' ... ' + newer[-1] if len(newer) > 1 else ''}), left from an abandoned "
              "trajectory (or an interrupted save); each is replaced when this run reaches its "
              "step")


# ---- saving ---------------------------------------------------------------------------------

def save_checkpoint(ckpt_dir: str | Path, state: TrainState, model: torch.nn.Module, engine,
                    config: TrainConfig, tokenizer=None, origin: Optional[Path] = None) -> str:
    """Save the run at `state` (on every rank); returns the line reporting it, `saved
    checkpoint DIR` or, when a folder of that step was already there, `replaced checkpoint DIR
    ...`. The checkpoint records `tokenizer` (the run's megamoe.train.tokenizer.Tokenizer) and
    holds its files, and the `hf_source/` of `origin` (the checkpoint the run started from) or
    of the newest earlier checkpoint (megamoe.train.checkpoint_tokenizer).

    Such a folder is newer than the checkpoint the run resumed from: it is left from an
    abandoned trajectory (a run rewound by pointing the tracker at an earlier step, as with
    Megatron-LM, or resumed past a corrupt checkpoint with `resume_from_verified`). It is
    replaced only once the new checkpoint is complete, and the tracker rewritten only once the
    new folder is in place, so a crash at any point leaves the run resumable. Parameters that
    are not finite are never saved: a DivergenceError names the first one. A failed write (e.g.
    a full disk) removes the partial folder and raises a one-line CheckpointError; the previous
    checkpoint and the tracker stay as they were.
    """
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir not in _PRE_RUN_VERIFIED:
        _PRE_RUN_VERIFIED[ckpt_dir] = newest_verified(ckpt_dir)
    name = checkpoint_name(state.iteration)
    final, tmp = ckpt_dir / name, ckpt_dir / f".{name}.tmp"
    _refuse_nonfinite(model, state.iteration)
    replacing = final.is_symlink() or final.exists()
    own_write_results_queue()
    if _rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    layout = _layout()
    schedule = LRSchedule.from_config(config.optimizer, config.training.train_steps)
    model_sharded = _model_entries(model, config)
    sharded = {
        **model_sharded,
        "optimizer": engine.optimizer_sharded_state_dict(model_sharded, is_loading=False),
        "rng_state": _rng_object(_rng_state()),
        **megatron_lm_common(config, state, model, layout, schedule),
        "train_state": dataclasses.asdict(state),
        "lr_schedule": dataclasses.asdict(schedule),
        "config": config.to_dict(),
        "layout": layout,
        "format_version": FORMAT_VERSION,
        **({TOKENIZER_KEY: tokenizer_record(tokenizer)} if tokenizer is not None else {}),
    }
    logged: list[str] = []
    try:
        with compat.checkpoint_writer_errors() as logged:
            dist_checkpointing.save(sharded, str(tmp))
        if _rank0():
            write_checkpoint_files(tmp, tokenizer, [origin, *saved_checkpoints(ckpt_dir)[::-1]])
        dist.barrier()
        write_manifest(tmp, collective=_distributed())
    except FAILURES as err:
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(err, tmp, ckpt_dir, logged) from None
    dist.barrier()
    if _rank0():
        # a folder being replaced goes aside (where the next run's lock removes it should this
        # process die here) and is deleted once the tracker names the new one
        aside = ckpt_dir / f".{name}.replaced.tmp"
        if replacing:
            _remove(aside)
            final.rename(aside)
        tmp.rename(final)
        write_tracker(ckpt_dir, state.iteration)
        _remove(aside)
        _prune(ckpt_dir, config.checkpoint.keep_last, _PRE_RUN_VERIFIED.get(ckpt_dir),
               state.iteration, config.data.tokenizer)
    dist.barrier()
    if replacing:
        return (f"replaced checkpoint {final}: the folder of step {state.iteration} there was "
                "newer than the checkpoint this run resumed from (left from an abandoned "
                "trajectory or an interrupted save)")
    return f"saved checkpoint {final}"


def _remove(path: Path) -> None:
    """Delete `path` whatever it is (a folder, a file or a link, which is not followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _refuse_nonfinite(model: torch.nn.Module, step: int) -> None:
    """A DivergenceError (on every rank alike) if any rank holds a NaN or Inf parameter."""
    bad = first_nonfinite_parameter(model)
    # on the parameters' device: NCCL reduces CUDA tensors only
    flag = torch.tensor([0.0 if bad is None else 1.0], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        where = describe_module(bad) if bad is not None else "a parameter on another rank"
        raise DivergenceError(f"step {step}: {where} is not finite after the update; nothing "
                              "was saved (lower optimizer.lr or resume from the last "
                              "checkpoint)")


def _save_error(err: BaseException, tmp: Path, ckpt_dir: Path,
                logged: list[str]) -> MegaMoEError:
    """One line for a failed save. Megatron-Core's writer processes report an OSError (e.g.
    ENOSPC) as a RuntimeError carrying its text inside DCP's per-rank CheckpointException
    (0.16), or only in the writer's `logged` messages (0.19)."""
    cause = find_exception(err, OSError) or find_exception(err, Exception) or err
    try:
        previous = latest_checkpoint(ckpt_dir)
    except CheckpointError:
        previous = None
    kept = f"the previous checkpoint {previous} is intact" if previous else "nothing was saved"
    text = first_line(cause)
    full = os.strerror(errno.ENOSPC)
    if getattr(cause, "errno", None) == errno.ENOSPC or full in text or \
            any(full in message for message in logged):
        return CheckpointError(f"cannot write checkpoint {tmp}: the disk is full ({text}); "
                               f"{kept}; free space or set checkpoint.dir, then run again to "
                               "resume")
    return CheckpointError(f"cannot write checkpoint {tmp}: {type(cause).__name__}: {text}; "
                           f"{kept}; run again to resume from it")


def _prune(ckpt_dir: Path, keep_last: int, protected: Optional[Path], step: int,
           tokenizer: Optional[str]) -> None:
    """Delete all but the newest `keep_last` checkpoints up to `step`, the one just saved (0
    keeps all), `protected`, and one holding the run's `data.tokenizer` (a checkpoint's
    tokenizer/ folder, as the docs suggest passing, stays for the next resume). Newer folders,
    left from an abandoned trajectory, are neither counted nor deleted here: each is replaced
    when the run reaches its step."""
    if keep_last <= 0:
        return
    read = Path(tokenizer).resolve() if tokenizer else None
    reached = [folder for folder in saved_checkpoints(ckpt_dir) if iteration_of(folder) <= step]
    for old in reached[:-keep_last]:
        if old != protected and not (read is not None and read.is_relative_to(old.resolve())):
            shutil.rmtree(old, ignore_errors=True)


# ---- loading --------------------------------------------------------------------------------

def interpret_common_state(common: dict, config: TrainConfig, path: Path
                           ) -> tuple[TrainState, Optional[dict]]:
    """(position, saved layout) from a checkpoint's common state after checking it is
    well-formed, records the step its folder is named after, and fits the config; the layout is
    None for a Megatron-LM checkpoint (weights and position only). A common state with megamoe's
    keys is megamoe's (or corrupt); Megatron-LM's is recognised by its own keys."""
    if is_megamoe_state(common):
        common = upgraded(common, path)
        state, layout = saved_position(common, path)
        check_folder_step(path, state.iteration, "train_state.iteration")
        if "iteration" in common:  # Megatron-LM's copy of the position, which its loader reads
            check_folder_step(path, common["iteration"], "iteration")
        check_compatible(common.get("config"), config, path)
        return state, layout
    if not is_megatron_lm_checkpoint(common):
        raise CheckpointError(f"{path} is neither a megamoe nor a Megatron-LM training "
                              "checkpoint (its common state has neither megamoe's train_state "
                              "nor Megatron-LM's args, checkpoint_version and iteration); use "
                              "checkpoint.init_from for model weights from elsewhere")
    check_megatron_lm_args(common, config, path)
    state = train_state_of(common)
    check_folder_step(path, state.iteration, "iteration")
    return state, None


def load_checkpoint(path: Path, model: torch.nn.Module, engine, config: TrainConfig,
                    tokenizer=None) -> TrainState:
    """Restore model, optimizer, RNG states (same layout only) and the run's position from a
    megamoe checkpoint, or weights and position from a Megatron-LM checkpoint of this model.
    `tokenizer` (the run's) says which vocabulary rows are real (`_load`); whether the
    checkpoint records it is checked before the model is built (`check_start`)."""
    require_verified(path)
    state, saved_layout = interpret_common_state(load_common_state(path), config, path)
    if saved_layout is None:
        _load_weights(path, model, config, tokenizer=tokenizer)
        engine.model_weights_changed()
        _warn(f"{path} is a Megatron-LM checkpoint: resuming its weights and position, with a "
              "fresh optimizer and RNG state")
        return state
    same_layout = saved_layout == _layout()
    model_sharded = _model_entries(model, config)
    request = {**model_sharded,
               "optimizer": engine.optimizer_sharded_state_dict(model_sharded, is_loading=True)}
    if same_layout:
        request["rng_state"] = _rng_object(None)
    loaded = _load(request, path, tokenizer=tokenizer)
    _load_model_entries(model, loaded)
    engine.load_optimizer_state_dict(loaded["optimizer"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return state


def _load(request: dict, path: Path, strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
          tokenizer=None):
    """Load `request` from `path`; the vocabulary tensors may differ from the checkpoint's in
    their padding rows when the run's `tokenizer` says which rows are real (`safe_dcp`)."""
    vocab_size = tokenizer.vocab_size if tokenizer is not None else None
    try:
        return load_dist_checkpoint(request, path, vocab_size, strict=strict)
    except MegaMoEError:
        raise
    except FAILURES as err:  # a checkpoint is user input: any failure to read it is one line
        raise CheckpointError(f"cannot load {path}: {type(err).__name__}: {first_line(err)}; "
                              "the checkpoint is corrupt or of another model") from None


def check_start(folder: Path, tokenizer, config: TrainConfig,
                init_from: bool = False) -> tuple[Optional[int], list[SettingChange]]:
    """Before a run builds anything from the checkpoint `folder` (resumed or, with `init_from`,
    its weights taken): verify it, refuse it in one line when it records another tokenizer than
    the run's `tokenizer` (`check_checkpoint_tokenizer`), a changed model setting (resumed,
    `check_compatible`) or a model of other shapes (`init_from`, `check_weights_fit`). Returns
    the rows of its word embedding (`embedding_rows`) and the training settings the config
    changes from those the checkpoint records, for the run to announce."""
    require_verified(folder)
    common = load_common_state(folder)
    if init_from:
        check_weights_fit(common, config, folder)
        sections = recorded_sections(common, folder)
        changes = ([] if sections is None else training_changes(
            sections, config, folder, recorded_only=not is_megamoe_state(common)))
    elif is_megamoe_state(common):
        saved_config = upgraded(common, folder).get("config")
        check_resumed_optimizer(saved_config, config.optimizer.name, folder)
        changes = (check_compatible(saved_config, config, folder)
                   + optimizer_changes(saved_config, config, folder))
    else:
        changes = []  # Megatron-LM's records its args, checked when it loads
    check_checkpoint_tokenizer(common, folder, tokenizer, config, _rank0())
    return embedding_rows(folder), changes


def embedding_rows(folder: Path) -> Optional[int]:
    """Rows of the word embedding saved in the torch_dist checkpoint `folder` (None if it has
    none, e.g. a pipeline stage's own folder), from its DCP metadata."""
    saved = read_dcp_metadata(folder / METADATA_FILE).state_dict_metadata
    size = getattr(saved.get("embedding.word_embeddings.weight"), "size", None)
    return int(size[0]) if size else None


def _load_weights(folder: Path, model: torch.nn.Module, config: TrainConfig,
                  new_key: Callable[[str], bool] = lambda key: False, tokenizer=None) -> None:
    def optional(key: str) -> bool:
        return key.endswith(_OPTIONAL_KEY_ENDINGS) or new_key(key)

    loaded, _, absent = _load(_model_entries(model, config), folder,
                              strict=StrictHandling.RETURN_ALL, tokenizer=tokenizer)
    required = sorted(k for k in absent if not optional(k))
    if required:
        raise CheckpointError(
            f"{folder} lacks {len(required)} model tensors, e.g. {required[:3]}; make the "
            "config's model and moe sections match the checkpoint"
        )
    missing = _load_model_entries(model, loaded, strict=False)
    required = [k for k in missing if not optional(k)]
    if required:
        raise CheckpointError(f"{folder} did not provide {required[:3]}; make the config's model "
                              "and moe sections match the checkpoint")


def load_model_weights(path: str | Path, model: torch.nn.Module, config: TrainConfig,
                       new_key: Optional[Callable[[str], bool]] = None,
                       tokenizer=None) -> Path:
    """Initialise `model` from the model weights of the checkpoint at `path` (see
    `resolve_weights_dir`), verified first; keys it lacks may only be extra state, expert
    biases and those `new_key` names (a fine-tuning method's own, left as initialised). A
    checkpoint recording a model of other shapes is refused (`check_weights_fit`, naming the
    setting); whether it records the run's tokenizer is checked before the model is built
    (`check_start`). With `tokenizer` the vocabulary may be padded
    differently (another tensor-parallel size): the real rows load, padding rows are added or
    dropped."""
    folder = resolve_weights_dir(path)
    require_verified(folder)
    common = load_common_state(folder)
    check_weights_fit(common, config, folder)
    _load_weights(folder, model, config, new_key or (lambda key: False), tokenizer)
    return folder
