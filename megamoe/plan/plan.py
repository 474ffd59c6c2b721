"""The memory plan of a layout: per rank and category, the bytes training holds at its peak.

Parameters, gradients and optimizer state are counted on a meta-device build of each
pipeline stage (`megamoe.plan.shards`); activations and MoE dispatch buffers are the terms of
`megamoe.plan.activations` at the peak of the pipeline schedule (`megamoe.plan.schedule`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megamoe.plan import activations as act
from megamoe.plan.layouts import Layout
from megamoe.plan.schedule import in_flight, peak
from megamoe.plan.shards import ChunkShard, StageShard, build_stage
from megamoe.plan.state import GRADIENTS, OPTIMIZER, PARAMETERS
from megamoe.plan.tracker import ACTIVATIONS, MOE
from megamoe.train.config import TrainConfig

CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, MOE)


@dataclass
class StagePlan:
    """What each rank of one pipeline stage holds at the step's peak."""

    stage: int
    ranks: range
    bytes: dict[str, float]
    """Per category (CATEGORIES)."""
    layers: list[int]
    """Global 1-based numbers of this stage's layers."""
    moe_layers: int
    in_flight: int
    """Micro-batch chunks whose activations are alive at once."""
    all_to_all_bytes_per_step: float
    """Bytes this rank sends in the step's MoE all-to-alls (forward, backward and
    recomputation; the busiest rank's combine)."""

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


@dataclass
class LayoutPlan:
    layout: Layout
    config: TrainConfig
    maxvio: float
    precision: str
    num_microbatches: int
    stages: list[StagePlan] = field(default_factory=list)

    @property
    def peak(self) -> float:
        """The largest rank total."""
        return max(s.total for s in self.stages)

    def rank_stage(self, rank: int) -> StagePlan:
        return self.stages[self.layout.stage_of(rank)]


def element_bytes(bf16: bool) -> int:
    return 2 if bf16 else 4


def _chunk_bytes(config: TrainConfig, chunk: ChunkShard, x: act.Shapes, maxvio: float
                 ) -> tuple[dict, dict, dict]:
    """(per micro-batch, transient of recomputation, once per rank) bytes of one chunk."""
    t = config.training
    kept, transient = [], {ACTIVATIONS: 0.0, MOE: 0.0}
    layers = [act.layer_terms(config, x, layer.moe, maxvio) for layer in chunk.layers]
    layers += [act.mtp_terms(config, x, depth.moe, maxvio) for depth in chunk.mtp]
    for terms in layers:
        if t.recompute == "full":
            terms, replayed = act.full_recompute(terms, x)
        elif t.recompute == "selective":
            terms, replayed = act.selective(terms, t.recompute_modules)
        else:
            replayed = []
        kept += terms
        for category, value in act.totals(replayed).items():
            transient[category] = max(transient[category], value)
    if chunk.embedding:
        kept += act.embedding_terms(config, x)
    # The losses' backward runs first and frees the output terms before any layer is replayed.
    losses = act.output_terms(config, x) if chunk.output else []
    losses += [term for _ in chunk.mtp for term in act.mtp_output_terms(config, x)]
    output = act.totals(losses)
    return (act.totals(kept + losses), {k: v - output[k] for k, v in transient.items()},
            act.totals(kept, per_microbatch=False))


def _all_to_all_bytes(config: TrainConfig, stage: StageShard, x: act.Shapes, maxvio: float,
                      num_microbatches: int) -> float:
    if x.ep == 1:
        return 0.0
    t = config.training
    replayed = t.recompute == "full" or (
        t.recompute == "selective" and bool({"mlp", "moe"} & set(t.recompute_modules)))
    passes = 2 + int(replayed)  # forward, backward, and the recomputed forward
    total = 0.0
    for chunk in stage.chunks:
        for layer in chunk.layers + chunk.mtp:
            if layer.moe is None or layer.moe.dispatcher.kind != "alltoall":
                continue
            sent, received = act.routed_rows(layer.moe, x.tokens, x.ep, maxvio)
            # dispatch sends this rank's rows, combine returns the rows it received; the
            # share (ep - 1) / ep leaves the rank.
            total += (sent + received) * x.h * x.e * (x.ep - 1) / x.ep
    return total * passes * num_microbatches


def plan_stage(config: TrainConfig, layout: Layout, shard: StageShard, vocab: int,
               bf16: bool, maxvio: float, num_microbatches: int,
               fused_attention: bool = False) -> StagePlan:
    """The plan of one pipeline stage from its counted shard."""
    x = act.Shapes(config.model.seq_length, config.training.micro_batch_size,
                   config.model.hidden_size, layout.tensor, layout.expert,
                   element_bytes(bf16), vocab, fused_attention)
    per_chunk, transient, once = zip(*(_chunk_bytes(config, c, x, maxvio)
                                       for c in shard.chunks))
    top = peak(per_chunk, transient, num_microbatches, layout.pipeline, shard.stage)
    for category in top:
        top[category] += max(o[category] for o in once)
    layers = [layer for chunk in shard.chunks for layer in chunk.layers]
    start = shard.stage * layout.ranks_per_stage
    return StagePlan(
        shard.stage, range(start, start + layout.ranks_per_stage),
        {**shard.state_bytes, **top}, [layer.number for layer in layers],
        sum(layer.moe is not None for layer in layers),
        in_flight(num_microbatches, len(shard.chunks), layout.pipeline, shard.stage),
        _all_to_all_bytes(config, shard, x, maxvio, num_microbatches))


def is_bf16(config: TrainConfig, device: str) -> bool:
    """Whether the trainer would run in bf16 on `device` (`cuda` or `cpu`)."""
    precision = config.training.precision
    return precision == "bf16" or (precision == "auto" and device == "cuda")


def plan_layout(config: TrainConfig, layout: Layout, vocab: int, maxvio: float,
                device: str = "cuda", progress=None) -> LayoutPlan:
    """Every stage of `layout` (config already at that layout), as the trainer runs it on
    `device`: on `cuda` in bf16 unless the config says fp32, with Transformer Engine's fused
    attention; on `cpu` in fp32 with Megatron's local attention (what `--measure` runs)."""
    bf16 = is_bf16(config, device)
    t = config.training
    num_microbatches = t.global_batch_size // (t.micro_batch_size * layout.data)
    plan = LayoutPlan(layout, config, maxvio, "bf16" if bf16 else "fp32", num_microbatches)
    for stage in range(layout.pipeline):
        shard = build_stage(config, layout, stage, bf16, vocab)
        plan.stages.append(plan_stage(config, layout, shard, vocab, bf16, maxvio,
                                      num_microbatches, fused_attention=device == "cuda"))
        if progress is not None:
            progress(stage)
    return plan
