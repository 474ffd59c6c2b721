"""Each pipeline stage's shard of the real model, built on the meta device as one rank of the
layout, through a fake process group: what the trainer would build, counted, never allocated.

One rank is built per pipeline stage (the ranks of a stage hold equal shards,
`megamoe.plan.layouts`): torch's `fake` backend gives the process that rank's place in a
world of any size (its collectives do nothing), Megatron-Core's parallel state is set up on it
as `megamoe.megatron.runtime.setup_megatron` does for training, and the trainer's own
`build_chunks` and `Engine` (DDP gradient buffers, distributed optimizer) run under
`cuda_as_meta`, so every tensor has its true shape and dtype and none has memory. A
671B-parameter model's stage builds in well under a second.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megamoe.config import MoEConfig
from megamoe.errors import ConfigError
from megamoe.megatron.compat import mtp_transformer_layer
from megamoe.plan.layouts import Layout
from megamoe.plan.state import initialise_optimizer_state, model_state_bytes
from megamoe.train.config import TrainConfig


@dataclass(frozen=True)
class LayerShard:
    """One transformer layer of a rank's chunk."""

    number: int
    """Global, 1-based (Megatron's layer_number)."""
    moe: Optional[MoEConfig]
    """The MoE layer's settings; None for a dense MLP."""
    local_experts: int = 0


@dataclass(frozen=True)
class ChunkShard:
    """One model chunk (virtual pipeline stage) of a rank."""

    embedding: bool
    output: bool
    layers: tuple[LayerShard, ...]
    mtp: tuple[LayerShard, ...] = ()
    """The transformer layer of each multi-token-prediction depth this chunk holds."""


@dataclass
class StageShard:
    """What every rank of one pipeline stage holds, counted on the meta device."""

    stage: int
    chunks: list[ChunkShard]
    state_bytes: dict[str, int]
    """{parameters, gradients, optimizer} (`megamoe.plan.state.model_state_bytes`)."""
    parameters: int
    """Parameter elements of the shard."""
    expert_parameters: int = 0


def model_vocab_size(config: TrainConfig) -> tuple[int, str]:
    """The vocabulary the trainer builds the model with, and where it came from: the
    tokenizer of `data.tokenizer` when that file or folder exists, else
    `data.vocab_size`."""
    data = config.data
    if data.tokenizer:
        path = Path(data.tokenizer).expanduser()
        if path.exists():
            from megamoe.train.tokenizer import load_tokenizer

            return load_tokenizer(path).vocab_size, str(path)
    return data.vocab_size, "data.vocab_size"


def _fake_backend() -> None:
    """Register torch's `fake` process-group backend (torch ships it with its test helpers)."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"
    except ImportError as err:  # pragma: no cover - every supported torch has it
        raise ConfigError(f"this torch has no fake process-group backend ({err}); the planner "
                          "needs torch >= 2.4") from None


@contextlib.contextmanager
def _gloo_groups_are_fake() -> Iterator[None]:
    """Megatron-Core also creates gloo groups; in a fake world they are fake too."""
    original = dist.new_group

    def new_group(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = None
        return original(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


@contextlib.contextmanager
def fake_rank(layout: Layout, rank: int, seed: int = 1234) -> Iterator[None]:
    """This process as rank `rank` of `layout` (fake collectives), with Megatron-Core's
    parallel state set up as for training; both undone on exit."""
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron

    if dist.is_initialized():
        raise ConfigError("the planner builds ranks in a process without torch.distributed; "
                          "run it outside torchrun")
    _fake_backend()
    # torch.distributed prefixes uncaught errors with the rank by wrapping sys.excepthook at
    # each init; the planner initialises many times, so keep the hook it found.
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=layout.world)
    try:
        with _gloo_groups_are_fake():
            setup_megatron(tensor_model_parallel_size=layout.tensor,
                           pipeline_model_parallel_size=layout.pipeline,
                           virtual_pipeline_model_parallel_size=layout.virtual_stages,
                           expert_model_parallel_size=layout.expert, seed=seed)
        try:
            yield
        finally:
            teardown_megatron()
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


def _layer_shard(layer: torch.nn.Module) -> LayerShard:
    from megamoe.layer import MoELayer

    mlp = layer.mlp
    if isinstance(mlp, MoELayer):
        return LayerShard(layer.layer_number, mlp.cfg, mlp.experts.num_local_experts)
    return LayerShard(layer.layer_number, None)


def chunk_shards(chunks: list[torch.nn.Module]) -> list[ChunkShard]:
    """The layers of each model chunk (and of its multi-token-prediction depths), read from
    the built modules."""
    out = []
    for chunk in chunks:
        mtp = getattr(chunk, "mtp", None)
        out.append(ChunkShard(
            chunk.pre_process, chunk.post_process,
            tuple(_layer_shard(layer) for layer in chunk.decoder.layers),
            () if mtp is None else tuple(_layer_shard(mtp_transformer_layer(depth))
                                         for depth in mtp.layers)))
    return out


def expert_elements(chunks: list[torch.nn.Module]) -> int:
    """Elements of the routed experts' weights (Megatron DDP's expert-parallel parameters)."""
    return sum(p.numel() for chunk in chunks for p in chunk.parameters()
               if not getattr(p, "allreduce", True))


_INIT_METHODS = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_,
                 torch.Tensor.zero_, torch.Tensor.copy_}


class _NoValuesOnMeta(TorchFunctionMode):
    """In-place initialisation of a meta tensor (which has no values) returns at once: torch
    runs `normal_` on the meta device through a Python reference, about a millisecond a call,
    and a 256-expert layer initialises each expert on its own."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        initialises = func in _INIT_METHODS or getattr(func, "__module__", "") == "torch.nn.init"
        target = args[0] if args else kwargs.get("tensor")
        if initialises and getattr(target, "is_meta", False):
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device, skipping their initialisation."""
    with torch.device("meta"), _NoValuesOnMeta():
        yield


def meta_transformer_config(config: TrainConfig, bf16: bool):
    """The run's TransformerConfig for a build on the meta device (no initialisation)."""
    from megamoe.train.model import transformer_config

    tc = transformer_config(config, on_cuda=False, bf16=bf16)
    tc.perform_initialization = False
    return tc


def build_stage(config: TrainConfig, layout: Layout, stage: int, bf16: bool,
                vocab_size: int, with_state: bool = True) -> StageShard:
    """Pipeline stage `stage` of `config` at `layout`, counted on the meta device: its chunks'
    layers, parameter elements, and (with `with_state`) the bytes of its parameters, DDP
    gradient buffers and distributed optimizer state."""
    from megamoe.megatron.cpu import cuda_as_meta
    from megamoe.train.engine import Engine
    from megamoe.train.model import build_chunks

    with fake_rank(layout, stage * layout.ranks_per_stage, config.training.seed):
        tc = meta_transformer_config(config, bf16)
        # cuda_as_meta: a last stage holding a copy of the embedding (multi-token prediction,
        # tied embeddings) has Megatron move it to CUDA for its all-reduce with the first's.
        with on_meta(), cuda_as_meta():
            chunks = build_chunks(config, tc, vocab_size)
        state = {}
        if with_state:
            with torch.device("meta"):  # the CPU's causal mask (seq_length^2) too
                engine = Engine(chunks, tc, config, on_cuda=False, device_context=cuda_as_meta)
            with cuda_as_meta():
                initialise_optimizer_state(engine.optimizer)
            state = model_state_bytes(chunks, engine.optimizer)
        return StageShard(stage, chunk_shards(chunks), state,
                          sum(p.numel() for c in chunks for p in c.parameters()),
                          expert_elements(chunks))
