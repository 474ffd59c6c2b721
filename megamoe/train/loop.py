"""The pretraining loop: set up Megatron-Core, build data, model and engine, resume, train, save.

One optimizer step:
1. learning rate from the schedule (a function of the step), set with the config's weight
   decay, betas and eps on every parameter group as Megatron-LM's scheduler does (`lr_mult`,
   `wd_mult`: no decay on biases and norms; `apply_step_settings`);
2. forward and backward of all micro-batches, gradients reduced over data-parallel replicas
   (Megatron-Core's DDP, distributed optimizer and pipeline schedules in `Engine`, on CPU and
   GPU alike), and the global gradient norm;
3. one all-reduce that sums the loss over ranks and tells every rank whether any was signalled
   and whether any saw a non-finite loss or gradient norm;
4. the divergence guards (megamoe.train.guards), on the reduced values so every rank decides
   alike: a non-finite value stops the run (exit code 3, nothing saved), a loss spike stops it
   or rolls back to the latest checkpoint and skips the spiking step's batch;
5. `step_balancing`: routing counts all-reduced over each router's replica group, expert biases
   updated at the step's rate (`balancing.bias_update_schedule`), per-layer MoE metrics (once
   per step, after the gradients are final);
6. clipped optimizer step;
7. metrics (with multi-token prediction, each depth's loss: `mtp/depth{k}/loss`), then a
   checkpoint every `checkpoint.interval` steps, at the end, and on a signal
   (after which the run exits 0 so SLURM can requeue it).
"""
from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megamoe.balancing import routers_of, step_balancing
from megamoe.checkpointing.layout import TrainState, latest_checkpoint
from megamoe.errors import ConfigError
from megamoe.megatron.runtime import setup_megatron, teardown_megatron
from megamoe.parallel.comm import TorchComm
from megamoe.routing.token_ids import capture_input_ids
from megamoe.train.checkpoint import (check_start, load_checkpoint, load_model_weights,
                                      resolve_weights_dir, resume_checkpoint, save_checkpoint)
from megamoe.train.config import TrainConfig, dump_config
from megamoe.train.engine import Engine
from megamoe.train.evaluate import HeldOutLoss
from megamoe.train.faults import VARIABLE, InjectedFaults, injected_faults
from megamoe.train.guards import (
    DivergenceError,
    LossSpikeGuard,
    NonFiniteTracer,
    Spike,
    diagnose,
    gather_diagnoses,
    nonfinite,
    poison_batch,
    poison_parameter,
)
from megamoe.train.inputs import NO_RECORD, data_sources, training_batches
from megamoe.train.methods import Evaluation, TrainingMethod, training_method
from megamoe.train.metrics import MetricsLogger
from megamoe.train.model import build_model, transformer_config
from megamoe.train.routing_records import RoutingRecords
from megamoe.train.run_lock import lock_output_dir
from megamoe.train.schedule import LRSchedule, apply_step_settings
from megamoe.train.signals import StopRequest
from megamoe.train.tokenizer import Tokenizer


def resolve_device(config: TrainConfig) -> tuple[bool, bool]:
    """(train on CUDA, use bf16) from `training.device` and `training.precision`."""
    t = config.training
    cuda = torch.cuda.is_available()
    if t.device == "cuda" and not cuda:
        raise ConfigError("training.device=cuda but no CUDA device is visible; use "
                          "training.device=auto or cpu")
    if t.device == "cpu" and cuda:
        raise ConfigError("training.device=cpu on a machine with CUDA: hide the GPUs "
                          "(CUDA_VISIBLE_DEVICES=) to train on CPU")
    bf16 = t.precision == "bf16" or (t.precision == "auto" and cuda)
    if bf16 and not cuda:
        raise ConfigError("training.precision=bf16 needs CUDA; use fp32 (or auto) on CPU")
    return cuda, bf16


def microbatches_per_step(config: TrainConfig, dp_size: int) -> int:
    """Gradient-accumulation steps: global batch / (micro batch x data-parallel size)."""
    t = config.training
    per_pass = t.micro_batch_size * dp_size
    if t.global_batch_size % per_pass:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp_size}; "
            "change the batch sizes or the number of ranks"
        )
    return t.global_batch_size // per_pass


def run(config: TrainConfig) -> int:
    """Train as the config says (on every rank); returns the process exit code."""
    on_cuda, bf16 = resolve_device(config)
    p = config.parallel
    setup_megatron(tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline,
                   virtual_pipeline_model_parallel_size=p.virtual_stages,
                   expert_model_parallel_size=p.expert, seed=config.training.seed,
                   timeout_s=config.training.collective_timeout_s)
    try:
        lock = lock_output_dir(config.output_dir, config.checkpoint_dir)
        try:
            with StopRequest(config.training.stop_grace_s) as stop:
                run_ = _prepare(config, on_cuda, bf16)
                # What setup built (libraries, model, optimizer) lives as long as the run: frozen
                # out of the cyclic collector, the full collections Megatron's distributed
                # optimizer runs at every save (two gc.collect() calls) walk only what the steps
                # allocate.
                gc.freeze()
                try:
                    _train(run_, stop)
                finally:
                    gc.unfreeze()
                    run_.logger.close()
        finally:
            lock.release()
        return 0
    finally:
        teardown_megatron()


@dataclass
class _Run:
    """Everything the loop needs, built and (if resuming) restored by `_prepare`."""

    config: TrainConfig
    model: torch.nn.Module
    engine: object
    state: TrainState
    batches: Iterator
    batches_from: Callable[[int], Iterator]
    """This rank's micro-batches from a global sample count on (after a rollback)."""
    num_microbatches: int
    pgs: ProcessGroupCollection
    device: torch.device
    logger: MetricsLogger
    method: Optional[TrainingMethod]
    """What `finetune.method` trains (None: pretraining)."""
    evaluation: Optional[Evaluation]
    """The method's evaluation (None when pretraining)."""
    prefixes: list[str]
    tokenizer: Tokenizer
    """The run's data and its tokenizer (`inputs.data_sources`), recorded in each checkpoint."""
    origin: Optional[Path]
    """The checkpoint folder the run started from (resumed or `init_from`), if any."""
    faults: InjectedFaults
    """What the fault tests inject (nothing in a real run)."""


def _prepare(config: TrainConfig, on_cuda: bool, bf16: bool) -> _Run:
    """Data, model and engine; resume from `latest` or start from `init_from`; the logger."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    num_microbatches = microbatches_per_step(config, dp_size)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"rank {rank}/{world} on {node}: data-parallel rank {dp_rank}, expert-parallel rank "
          f"{parallel_state.get_expert_model_parallel_rank()}, output {config.output_dir}",
          flush=True)

    faults = injected_faults()
    prefixes, tokenizer, unrecorded = data_sources(config)
    resume_from = resume_checkpoint(config)
    init_from = (resolve_weights_dir(config.checkpoint.init_from)
                 if resume_from is None and config.checkpoint.init_from else None)
    start = resume_from or init_from
    rows, changes = (check_start(start, tokenizer, config, init_from=init_from is not None)
                     if start is not None else (None, []))
    # released models pad their vocabulary (Qwen3-MoE: 151,936 rows for 151,669 ids): the model
    # takes the rows of the checkpoint it starts from, so its weights (and export) keep them
    vocab_size = max(tokenizer.vocab_size, rows or 0)
    tc = transformer_config(config, on_cuda, bf16)
    device = torch.device("cuda" if on_cuda else "cpu")
    evaluation = instructions = None
    method = training_method(config.finetune.method)
    if method is not None:
        instructions = method.batches(config, tokenizer, dp_rank, dp_size)
        evaluation = method.evaluation(config, tokenizer, device)
        chunks = method.build_model(config, tc, vocab_size)
    else:
        chunks = build_model(config, tc, vocab_size)
    for chunk in chunks:  # hash routing reads the token ids of every forward
        capture_input_ids(chunk)
    engine = Engine(chunks, tc, config, on_cuda,
                    routes_prompt=method is not None and method.routes_prompt)
    records = config.training.routing_replay or config.training.routing_record
    if records:
        engine.routing = RoutingRecords(
            chunks, records, replay=bool(config.training.routing_replay),
            tokens=config.model.seq_length * config.training.micro_batch_size)
    # One module for the loop's per-model helpers (balancing, guards, checkpoints).
    model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)

    state, origin = TrainState(), "a fresh initialisation"
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, engine, config, tokenizer=tokenizer)
        origin = (f"{resume_from} (step {state.iteration}, {state.consumed_samples} samples "
                  "consumed)")
    elif init_from is not None:
        loaded = load_model_weights(init_from, model, config,
                                    new_key=method.is_own_state if method else None,
                                    tokenizer=tokenizer)
        origin = f"the weights of {loaded}"
        engine.model_weights_changed()
    if rank == 0:
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_config(config))
    logger = MetricsLogger(config, active=rank == 0, start_step=state.iteration)
    p = config.parallel
    logger.message(
        f"training {config.training.train_steps} steps on {world} rank(s) "
        f"({'CUDA, ' + ('bf16' if bf16 else 'fp32') if on_cuda else 'CPU, fp32'}; data "
        f"{dp_size} x expert {p.expert} x tensor {p.tensor} x pipeline {p.pipeline}"
        f"{f' x {p.virtual_stages} virtual' if p.virtual_stages > 1 else ''}), "
        f"{_trainable_summary(model)} on rank 0, starting from {origin}; "
        f"{_data_line(tokenizer, unrecorded)}; output in {config.output_dir}")
    for change in changes:  # training settings changed from the checkpoint's, announced once
        logger.setting_changed(state.iteration + 1, *change)

    def batches_from(start_sample: int) -> Iterator:
        if instructions is not None:
            return instructions(start_sample)
        return training_batches(config, prefixes, tokenizer, dp_rank, dp_size, start_sample)

    return _Run(config, model, engine, state, batches_from(state.consumed_samples),
                batches_from, num_microbatches, pgs, device, logger, method, evaluation,
                prefixes, tokenizer, start, faults)


def _data_line(tokenizer: Tokenizer, unrecorded: list[str]) -> str:
    """What the start line says of the data's tokenizer: data without a record beside it (made
    elsewhere) was only range-checked against it."""
    if unrecorded:
        return f"data {', '.join(unrecorded)}: {NO_RECORD} against {tokenizer.describe()}"
    return f"data tokenized with {tokenizer.describe()}"


def _train(run: _Run, stop: StopRequest) -> None:
    """Optimizer steps until train_steps, an exit interval or a stop signal (see the module
    docstring for the order of one step). Raises DivergenceError when a guard stops the run."""
    config, engine, logger, guards = run.config, run.engine, run.logger, run.config.guards
    schedule = LRSchedule.from_config(config.optimizer, config.training.train_steps)
    replica_comm = TorchComm(run.pgs.tp_dp_cp)
    batch_size = config.training.global_batch_size
    tokens_per_step = batch_size * config.model.seq_length
    spikes = LossSpikeGuard(guards)
    tracer = NonFiniteTracer(run.model) if guards.nonfinite else None
    skip_at: set[int] = set()  # data positions whose step batch a rollback skips
    rollbacks = 0
    state = run.state
    heldout = HeldOutLoss.for_run(config, run.device, run.prefixes, run.tokenizer)
    while state.iteration < config.training.train_steps:
        start = time.perf_counter()
        step = state.iteration + 1
        while state.consumed_samples in skip_at:
            for _ in range(run.num_microbatches):
                next(run.batches)
            state = TrainState(state.iteration, state.consumed_samples + batch_size)
        batches = _inject_faults(run, step, state.consumed_samples)
        lr = schedule(step)
        apply_step_settings(engine.optimizer, config.optimizer, lr)
        if tracer is not None:
            tracer.reset()
        totals = engine.forward_backward(batches, run.num_microbatches, step)
        grad_norm = engine.grad_norm()
        # One collective: the loss over all ranks, whether any rank was signalled, and whether
        # any saw a non-finite loss or gradient norm.
        local_bad = nonfinite(float(totals[0]), float(grad_norm))
        reduced = torch.tensor([*totals.tolist(), float(stop.requested), float(local_bad)],
                               device=run.device)
        dist.all_reduce(reduced)
        loss_sum, tokens, *mtp_sums, stops, bad = reduced.tolist()
        loss = loss_sum / max(tokens, 1.0)
        if guards.nonfinite and bad > 0:
            _stop_nonfinite(run, tracer, step, loss, float(grad_norm))
        spike = spikes.check(loss)
        if spike is not None:
            if guards.spike_action != "rollback" or rollbacks >= guards.max_rollbacks:
                _stop_spike(run, step, spike, rollbacks)
            skip_at.add(state.consumed_samples)
            state = _rollback(run, step, spike, state.consumed_samples)
            spikes.rewind(state.iteration)
            rollbacks += 1
            continue
        spikes.accept(step, loss)
        moe_metrics = step_balancing(run.model, replica_comm, step=step)
        moe_metrics.update(mtp_metrics(mtp_sums, config))
        moe_metrics.update(engine.step(grad_norm))
        if run.method is not None:
            moe_metrics.update(run.method.after_step(run.model))
        state = TrainState(step, state.consumed_samples + batch_size)
        if config.parallel.pipeline > 1:
            moe_metrics = _gather_pipeline_metrics(moe_metrics, run.pgs.pp)
        elapsed = time.perf_counter() - start
        routing = engine.routing.suspended() if engine.routing else contextlib.nullcontext()
        with engine.device_context(), routing:  # Megatron's TP collectives on the CPU
            if heldout is not None and heldout.due(step):
                moe_metrics.update(heldout(run.model))
            if run.evaluation is not None and run.evaluation.due(step):
                moe_metrics.update(run.evaluation(run.model))
        logger.log(step, {"loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                          "tokens_per_s": tokens_per_step / elapsed, "step_time_s": elapsed,
                          "consumed_samples": state.consumed_samples, **moe_metrics})
        stop.step_ended()
        exiting = stops > 0 or _every(step, config.training.exit_interval)
        if exiting or step == config.training.train_steps or \
                _every(step, config.checkpoint.interval):
            logger.message(save_checkpoint(config.checkpoint_dir, state, run.model, engine,
                                           config, run.tokenizer, run.origin))
        if exiting and step < config.training.train_steps:
            reason = "on a signal" if stops > 0 else "at training.exit_interval"
            logger.message(f"stopping after step {step} {reason}; run the same command again "
                           "to resume")
            return


def mtp_metrics(sums: list[float], config: TrainConfig) -> dict[str, float]:
    """`mtp/depth{k}/loss`: depth k's multi-token-prediction loss of the step, the mean over the
    step's micro-batches of each one's mean token loss (what Megatron-Core trains, before the
    weight lambda / D), from the per-depth sums over all ranks (`Engine.forward_backward`)."""
    microbatches = microbatches_per_step(config, 1)
    return {f"mtp/depth{k}/loss": total / microbatches for k, total in enumerate(sums, start=1)}


def _inject_faults(run: _Run, step: int, position: int) -> Iterator:
    """The step's batches, after the fault tests' faults (`megamoe.train.faults`, if any) are
    injected: a NaN weight before step `nan_step`, labels 0 for the batch at the data position
    of step `spike_step` of an uninterrupted run."""
    faults = run.faults
    if step == faults.nan_step:
        name = poison_parameter(run.model, faults.nan_param)
        run.logger.message(f"{VARIABLE} nan_step={step}: set an element of {name} to NaN")
    if faults.spike_step and \
            position == (faults.spike_step - 1) * run.config.training.global_batch_size:
        run.logger.message(f"{VARIABLE} spike_step: labels 0 for the batch at sample "
                           f"{position} (step {step})")
        return (poison_batch(batch) for batch in run.batches)
    return run.batches


def _latest_name(run: _Run) -> str:
    latest = latest_checkpoint(run.config.checkpoint_dir)
    return f"the latest checkpoint, {latest}, is untouched" if latest else "no checkpoint exists"


def _stop_nonfinite(run: _Run, tracer, step: int, loss: float, grad_norm: float) -> None:
    where = gather_diagnoses(diagnose(run.model, tracer))
    text = (f"step {step}: non-finite loss or gradient norm (loss {loss}, grad norm "
            f"{grad_norm} on rank 0); {where}. The update was not applied and nothing was saved; "
            f"{_latest_name(run)}")
    run.logger.event(step, "nonfinite", text, echo=False, loss=str(loss),
                     grad_norm=str(grad_norm), where=where)
    raise DivergenceError(text)


def _stop_spike(run: _Run, step: int, spike: Spike, rollbacks: int) -> None:
    guards = run.config.guards
    why = ("guards.spike_action=stop" if guards.spike_action == "stop" else
           f"{rollbacks} rollback(s) already (guards.max_rollbacks={guards.max_rollbacks})")
    text = (f"step {step}: loss spike, {spike}; stopping ({why}). The update was not applied "
            f"and nothing was saved; {_latest_name(run)}")
    run.logger.event(step, "loss_spike", text, echo=False, loss=spike.loss,
                     moving_average=spike.average, action="stop")
    raise DivergenceError(text)


def _rollback(run: _Run, step: int, spike: Spike, position: int) -> TrainState:
    """Reload the latest checkpoint (on every rank) and restart the data there; the caller skips
    the batch at `position` when the replay reaches it."""
    checkpoint = latest_checkpoint(run.config.checkpoint_dir)
    if checkpoint is None:
        text = (f"step {step}: loss spike, {spike}; no checkpoint to roll back to (set "
                "checkpoint.interval, or guards.spike_action=stop). The update was not applied "
                "and nothing was saved")
        run.logger.event(step, "loss_spike", text, echo=False, loss=spike.loss,
                         moving_average=spike.average, action="stop")
        raise DivergenceError(text)
    state = load_checkpoint(checkpoint, run.model, run.engine, run.config, run.tokenizer)
    for router in routers_of(run.model):  # the spiked step's routing counts go with it
        router.discard_step()
    run.batches = run.batches_from(state.consumed_samples)
    batch_size = run.config.training.global_batch_size
    run.logger.event(step, "rollback",
                     f"step {step}: loss spike, {spike}; rolled back to {checkpoint} (step "
                     f"{state.iteration}); the batch of samples {position}..."
                     f"{position + batch_size - 1} will be skipped",
                     loss=spike.loss, moving_average=spike.average, checkpoint=str(checkpoint),
                     resumed_step=state.iteration,
                     skipped_samples=[position, position + batch_size])
    return state


def _trainable_summary(model: torch.nn.Module) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"{trainable:,} of {total:,} parameters train"


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def _gather_pipeline_metrics(metrics: dict, pp_group) -> dict:
    """Every pipeline stage's MoE metrics (each stage reports its own layers)."""
    gathered = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, metrics, group=pp_group)
    return {key: value for stage in gathered for key, value in stage.items()}
