"""Parallel layouts: the config's own, or every layout of a world size that the trainer
accepts, and where each rank sits in one.

A layout is (tensor, pipeline, virtual stages, expert) with data parallelism taking the
remaining ranks, as `megamoe.train.config.ParallelConfig` says; expert data parallelism is
world / (expert x pipeline). Megatron-Core orders ranks tensor fastest and pipeline slowest, so
pipeline stage p holds ranks [p * world / pipeline, (p + 1) * world / pipeline); the ranks of
one stage hold shards of equal size (tensor, expert and data-parallel shards are even).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from megamoe.errors import ConfigError
from megamoe.train.config import TrainConfig, config_from_dict


@dataclass(frozen=True)
class Layout:
    """A parallel layout of `world` ranks."""

    world: int
    tensor: int = 1
    pipeline: int = 1
    virtual_stages: int = 1
    expert: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def data(self) -> int:
        """Data-parallel size."""
        return self.world // (self.tensor * self.pipeline)

    @property
    def expert_data(self) -> int:
        """Expert-data-parallel size (the ranks that hold the same experts)."""
        return self.world // (self.expert * self.pipeline)

    @property
    def ranks_per_stage(self) -> int:
        return self.world // self.pipeline

    def stage_of(self, rank: int) -> int:
        """The pipeline stage of global rank `rank`."""
        return rank // self.ranks_per_stage

    def name(self) -> str:
        parts = [f"TP{self.tensor}", f"PP{self.pipeline}"]
        parts += [f"VP{self.virtual_stages}"] if self.virtual_stages > 1 else []
        parts += [f"EP{self.expert}", f"DP{self.data}"]
        return " ".join(parts)

    def parallel_section(self) -> dict:
        """The config's `parallel` section for this layout."""
        return {"tensor": self.tensor, "pipeline": self.pipeline,
                "virtual_stages": self.virtual_stages, "expert": self.expert,
                "first_stage_layers": self.first_stage_layers,
                "last_stage_layers": self.last_stage_layers}


def config_layout(config: TrainConfig, world: int | None = None) -> Layout:
    """The layout the config describes, on `world` ranks (None: as few as it needs:
    tensor x pipeline x expert / gcd, i.e. data parallelism just wide enough for the experts)."""
    p = config.parallel
    if world is None:
        world = minimal_world(p.tensor, p.pipeline, p.expert)
    layout = Layout(world, p.tensor, p.pipeline, p.virtual_stages, p.expert,
                    p.first_stage_layers, p.last_stage_layers)
    check_world(layout)
    t = config.training
    if t.global_batch_size % (t.micro_batch_size * layout.data):
        raise ConfigError(
            f"--ranks {world}: the layout {layout.name()} has {layout.data} data-parallel "
            f"ranks, which training.global_batch_size={t.global_batch_size} does not split "
            f"into micro-batches of {t.micro_batch_size}; choose other --ranks or batch sizes")
    return layout


def minimal_world(tensor: int, pipeline: int, expert: int) -> int:
    """The fewest ranks a layout runs on: a multiple of tensor x pipeline and of expert x
    pipeline."""
    from math import lcm

    return pipeline * lcm(tensor, expert)


def check_world(layout: Layout) -> None:
    """Refuse a world size the layout does not divide (as Megatron-Core would, later)."""
    if layout.world % (layout.tensor * layout.pipeline) or \
            layout.world % (layout.expert * layout.pipeline):
        raise ConfigError(
            f"--ranks {layout.world} does not fit the layout {layout.name()}: it must be a "
            f"multiple of tensor x pipeline = {layout.tensor * layout.pipeline} and of expert x "
            f"pipeline = {layout.expert * layout.pipeline}")


def with_layout(config: TrainConfig, layout: Layout) -> TrainConfig:
    """`config` at `layout` (validated as the trainer validates it; ConfigError if refused)."""
    raw = config.to_dict()
    raw["parallel"] = {**raw["parallel"], **layout.parallel_section()}
    return config_from_dict(raw, f"at layout {layout.name()}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts_of_world(config: TrainConfig, world: int) -> Iterator[tuple[Layout, TrainConfig]]:
    """Every layout of `world` ranks the trainer accepts for `config` (its config check:
    tensor dividing the heads, key-value groups and dense layers' MLP; expert dividing every
    layer's experts), with even pipeline stages and no virtual stages, and the config at that
    layout. Layouts whose global batch does not split over their data-parallel ranks are
    skipped."""
    t = config.training
    for tensor in _divisors(world):
        for pipeline in _divisors(world // tensor):
            if config.model.num_layers % pipeline:
                continue
            for expert in _divisors(world // pipeline):
                layout = Layout(world, tensor, pipeline, 1, expert)
                if t.global_batch_size % (t.micro_batch_size * layout.data):
                    continue
                try:
                    yield layout, with_layout(config, layout)
                except ConfigError:
                    continue

