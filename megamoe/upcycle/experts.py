"""The MoE weights of one layer, computed from its dense MLP by a recipe.

Expert e = shard (e mod G) of the dense MLP (a full copy when G = 1), then drop-upcycling, then
the output scale folded into its matrices, then noise. Every random draw comes from a generator
seeded by (recipe seed, layer, purpose, expert), so any expert can be rebuilt alone, in any
order, and a layer's result does not depend on which other layers were converted.
"""
from __future__ import annotations

import numpy as np
import torch

from megamoe.upcycle.drop import add_noise, drop_upcycle
from megamoe.upcycle.granular import (MLPWeights, MatrixFactors, apply_factors,
                                      expert_shard_index, init_router, output_scale,
                                      scale_factors, shard)
from megamoe.upcycle.recipe import UpcycleRecipe

_ROUTER, _DROP, _NOISE = 0, 1, 2


def seeded_generator(seed: int, layer: int, purpose: int, expert: int = 0) -> torch.Generator:
    """An independent CPU generator for one (layer, purpose, expert) stream of a recipe seed."""
    state = np.random.SeedSequence([seed, layer, purpose, expert]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class LayerUpcycler:
    """Builds the router, routed experts and shared expert of one MoE layer.

    dense: the layer's dense MLP; activation: its resolved activation name (for the `paper`
    scaling rule). Tensors come back in the dense weights' dtype; arithmetic is done in fp32.
    """

    def __init__(self, recipe: UpcycleRecipe, dense: MLPWeights, layer: int, activation: str):
        self.recipe = recipe
        self.layer = layer
        self.dtype = dense.fc1.dtype
        self.dense = dense.to(torch.float32)
        scale = output_scale(recipe.num_experts, recipe.topk, recipe.granularity,
                             recipe.score_function, recipe.pre_softmax)
        if recipe.shared_expert:
            scale /= 2  # the shared expert carries the other half of the dense output
        self.factors = scale_factors(scale, dense.gated, activation, recipe.weight_scaling)
        self._last_expert: tuple[int, MLPWeights] | None = None

    def router_weight(self) -> torch.Tensor:
        """Router weight [E, H]."""
        r = self.recipe
        weight = init_router(r.router_init, r.num_experts, r.granularity, self.dense.fc1.shape[1],
                             r.router_init_std, seeded_generator(r.seed, self.layer, _ROUTER))
        return weight.to(self.dtype)

    def expert_bias(self) -> torch.Tensor:
        """Loss-free balancing bias [E], fp32 zeros (arXiv 2408.15664 starts from zero)."""
        return torch.zeros(self.recipe.num_experts, dtype=torch.float32)

    def expert(self, index: int) -> MLPWeights:
        """Routed expert `index`. The last one is kept, since a checkpoint writer asks for its
        matrices one after another."""
        if self._last_expert is None or self._last_expert[0] != index:
            self._last_expert = (index, self._build_expert(index))
        return self._last_expert[1]

    def _build_expert(self, index: int) -> MLPWeights:
        r = self.recipe
        mlp = shard(self.dense, expert_shard_index(index, r.granularity), r.granularity)
        if r.drop_ratio > 0:
            mlp = drop_upcycle(mlp, r.drop_ratio,
                               seeded_generator(r.seed, self.layer, _DROP, index))
        mlp = apply_factors(mlp, self.factors)
        if r.noise_std > 0:
            mlp = add_noise(mlp, r.noise_std, seeded_generator(r.seed, self.layer, _NOISE, index))
        return mlp.to(self.dtype)

    def shared_expert(self) -> MLPWeights:
        """The dense MLP with its output halved (the routed experts carry the other half); with
        `shared_expert_gate` unchanged, since the zero-initialised gate halves it."""
        half = 1.0 if self.recipe.shared_expert_gate else 0.5
        return apply_factors(self.dense, MatrixFactors(1.0, 1.0, half)).to(self.dtype)

    def shared_expert_gate(self) -> torch.Tensor:
        """Shared-expert gate weight [1, H], zeros: sigmoid(0) = 0.5."""
        return torch.zeros(1, self.dense.fc1.shape[1], dtype=self.dtype)
