"""Start and stop torch.distributed plus Megatron-Core's model-parallel state, on CPU or GPU."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megamoe.errors import ConfigError
from megamoe.megatron.cpu import enable_megatron_on_cpu
from megamoe.megatron.local_fallbacks import enable_local_fallbacks

# Whether the default process group was created by setup_megatron (and so is ours to destroy).
_OWN_PROCESS_GROUP = False


def _init_process_group(timeout: datetime.timedelta) -> None:
    """gloo on CPU, nccl on CUDA; from a launcher's env (torchrun, srun wrappers) or alone."""
    global _OWN_PROCESS_GROUP
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        # A single process: the OS picks a free loopback port for the store.
        store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    _OWN_PROCESS_GROUP = True


def _check_sizes(world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> None:
    sizes = dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    for name, size in sizes.items():
        if size < 1:
            raise ConfigError(f"{name} size {size} must be >= 1")
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; "
            "change the parallel sizes or the number of ranks"
        )
    if world_size % (etp * ep * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}; "
            "change the parallel sizes or the number of ranks"
        )


def setup_megatron(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    context_parallel_size: int = 1,
    seed: int = 1234,
    timeout_s: float = 300.0,
) -> None:
    """Initialise torch.distributed (if needed), Megatron's parallel groups and its RNG states.

    It first applies `enable_local_fallbacks()` and, without CUDA, `enable_megatron_on_cpu()`.
    A process group that already exists is used as is; otherwise one is created (env:// when
    RANK and WORLD_SIZE are set, else a single process). Collectives that wait longer than
    `timeout_s` (a dead rank) raise instead of hanging. Seeds the CPU generator (Megatron's CPU
    weight initialisation) and Megatron's tracked data-, tensor- and expert-parallel RNG states
    with `seed`; the trainer then redraws the weights layout-invariantly
    (`megamoe.megatron.seeded_init`).
    """
    if parallel_state.model_parallel_is_initialized():
        raise ConfigError(
            "Megatron's model-parallel state is already initialised; call teardown_megatron() first"
        )
    enable_local_fallbacks()
    if not torch.cuda.is_available():
        enable_megatron_on_cpu()
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        _init_process_group(timeout)
    try:
        _check_sizes(
            dist.get_world_size(),
            tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size,
            cp=context_parallel_size,
            ep=expert_model_parallel_size,
            etp=expert_tensor_parallel_size,
        )
    except ConfigError:
        teardown_megatron()
        raise
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=(virtual_pipeline_model_parallel_size
                                              if virtual_pipeline_model_parallel_size > 1
                                              else None),
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_s / 60,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    _reset_aux_loss_scale()


def _reset_aux_loss_scale() -> None:
    """Forget the auxiliary-loss gradient scale Megatron-Core keeps in a class attribute: one
    left by an earlier model in this process (a backward outside Megatron's schedules makes it
    a 0-d tensor) would fail the shape of the scale the schedules then copy into it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def teardown_megatron() -> None:
    """Undo `setup_megatron`: destroy Megatron's parallel state, and the process group if
    setup_megatron created it (one the caller created is left to the caller)."""
    global _OWN_PROCESS_GROUP
    parallel_state.destroy_model_parallel()
    if _OWN_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_PROCESS_GROUP = False
