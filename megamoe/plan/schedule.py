"""The peak of a rank's saved activations over one step of Megatron-Core's pipeline schedule.

The schedule (`megatron.core.pipeline_parallel.schedules`): without pipelining, each
micro-batch's forward is followed by its backward; with pipelining (1F1B, PipeDream-Flush,
arXiv 2006.09503), rank p of P first runs W = P - p - 1 forwards, then alternates one forward
and one backward, then finishes the W backwards; interleaved over v virtual stages (arXiv
2104.04473) W = 2 (P - p - 1) + (v - 1) P chunk-forwards, in groups of P micro-batches per
chunk, backwards through the chunks in reverse. When W covers every forward, all forwards
run first. A micro-batch's saved tensors live from its forward to its backward; during a
backward, the layers recomputation replays add one layer's worth (`transient`).
"""
from __future__ import annotations

from typing import Sequence


def forward_order(num_microbatches: int, chunks: int, group: int) -> list[int]:
    """The chunk of each forward in schedule order (Megatron's schedule table)."""
    order = []
    for start in range(0, num_microbatches, group):
        for chunk in range(chunks):
            order += [chunk] * (min(start + group, num_microbatches) - start)
    return order


def warmup_forwards(num_microbatches: int, chunks: int, stages: int, stage: int) -> int:
    """Forwards before the first backward (Megatron's `get_pp_rank_microbatches`)."""
    total = num_microbatches * chunks
    if stages == 1:
        return 0
    warmup = stages - stage - 1 if chunks == 1 else \
        (stages - stage - 1) * 2 + (chunks - 1) * stages
    return min(warmup, total)


def in_flight(num_microbatches: int, chunks: int, stages: int, stage: int) -> int:
    """The most micro-batch chunks holding activations at once."""
    total = num_microbatches * chunks
    return min(warmup_forwards(num_microbatches, chunks, stages, stage) + 1, total)


def peak(per_chunk: Sequence[dict[str, float]], transient: Sequence[dict[str, float]],
         num_microbatches: int, stages: int, stage: int) -> dict[str, float]:
    """Peak bytes per category over the step: `per_chunk[c]` is what one micro-batch keeps in
    chunk c, `transient[c]` what recomputing one of its layers adds during a backward."""
    chunks = len(per_chunk)
    forwards = forward_order(num_microbatches, chunks, stages)
    backwards = [chunks - 1 - c for c in forwards]
    warmup = warmup_forwards(num_microbatches, chunks, stages, stage)
    categories = list(per_chunk[0])
    live = dict.fromkeys(categories, 0.0)
    top = dict(live)

    def forward(chunk: int) -> None:
        for k in categories:
            live[k] += per_chunk[chunk][k]
            top[k] = max(top[k], live[k])

    def backward(chunk: int) -> None:
        for k in categories:
            top[k] = max(top[k], live[k] + transient[chunk][k])
            live[k] -= per_chunk[chunk][k]

    f = b = 0
    for _ in range(warmup):
        forward(forwards[f])
        f += 1
    while f < len(forwards):
        forward(forwards[f])
        f += 1
        backward(backwards[b])
        b += 1
    while b < len(backwards):
        backward(backwards[b])
        b += 1
    return top
