"""Layout-invariant random draws of the forward pass: each transformer layer (and the embedding)
draws its dropout masks and router jitter from generators seeded by (seed, step, micro-batch,
global layer number), whichever pipeline stage, expert-parallel or data-parallel rank runs it.

Megatron-Core draws them from the default generator and from its tracked tensor-parallel
generator in the order a rank runs its layers: a pipeline stage starts where it starts, not
where layer 0 left the stream, and a data-parallel rank runs other micro-batches. Re-seeding both
at the entry of every layer, from the layer's global number and the micro-batch's index in the
step's global batch (`k * dp_size + dp_rank` for a rank's k-th, as the data is split), makes a
draw independent of who runs it. The micro-batch's key is kept among the tracked RNG states, so
activation recomputation, which restores those states before it replays a layer, replays the
layer's draws exactly.

Across tensor parallelism the draws stay rank-dependent, as in Megatron-Core: with sequence
parallelism each rank drops its own sequence shard of the hidden states with the same stream,
and attention dropout draws each rank's heads from a stream of that rank (the tracked
tensor-parallel state). Matching one process there would need the full tensor's mask on every
rank; megamoe does not do that.
"""
from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.language_model_embedding import \
    LanguageModelEmbedding
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker, get_cuda_rng_tracker
from megatron.core.transformer.transformer_layer import TransformerLayer

from megamoe.megatron.compat import transformer_layer_number
from megamoe.megatron.seeded_init import hashed_seed

MICROBATCH_KEY = "megamoe-microbatch"
"""The tracked-RNG-state entry holding (step, micro-batch index) while a micro-batch runs."""


class LayerSeeds:
    """Seeds every layer's draws of `chunks` (this pipeline rank's model) from `seed` and the
    running micro-batch (`start_microbatch`)."""

    def __init__(self, chunks: list[torch.nn.Module], seed: int) -> None:
        self.seed = seed
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TransformerLayer):
                    module.register_forward_pre_hook(functools.partial(
                        self._enter, transformer_layer_number(module)))
                elif isinstance(module, LanguageModelEmbedding):
                    module.register_forward_pre_hook(functools.partial(self._enter, 0))

    @staticmethod
    def start_microbatch(step: int, index: int) -> None:
        """The forward passes that follow belong to micro-batch `index` (its position in the
        step's global batch) of optimizer step `step`."""
        tracker = get_cuda_rng_tracker()
        tracker.set_states({**tracker.get_states(),
                            MICROBATCH_KEY: torch.tensor([step, index], dtype=torch.int64)})

    def _enter(self, layer: int, module: torch.nn.Module, args) -> None:
        tracker = get_cuda_rng_tracker()
        states = tracker.get_states()
        if not module.training or MICROBATCH_KEY not in states:
            return
        step, index = states[MICROBATCH_KEY].tolist()
        torch.manual_seed(hashed_seed(self.seed, step, index, layer))
        fresh = CudaRNGStatesTracker()
        for name in states:
            if name != MICROBATCH_KEY:
                fresh.add(name, hashed_seed(self.seed, step, index, layer, name, self.tp_rank))
        tracker.set_states({**fresh.get_states(), MICROBATCH_KEY: states[MICROBATCH_KEY]})
