"""Sparse and granular upcycling of one dense MLP, as pure tensor functions.

Sparse upcycling (Komatsuzaki et al., arXiv 2212.05055) copies the dense MLP into every expert.
Granular upcycling with virtual groups (He et al., NVIDIA, arXiv 2410.07524) splits the dense MLP
into G shards along the intermediate dimension (gate and up halves of a GLU split separately)
and repeats the shard list E/G times; the router starts with E/G random rows, each repeated G
times, so the G shards of one copy are chosen together and, with K a multiple of G and the right
output scale, the MoE layer starts out computing exactly the dense function.

Weights are in Megatron-Core's (out, in) orientation. Shape legend: H hidden, F dense FFN size
(per GLU half), S = F / G expert FFN size, E experts. fc1 is [F', H] with F' = 2F for a GLU
([gate; up] stacked along the output dimension), fc2 is [H, F].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.errors import CheckpointError


@dataclass(frozen=True)
class MLPWeights:
    """One MLP's weights: fc1 [F', H] (GLU: gate rows first, then up rows), fc2 [H, F]."""

    fc1: torch.Tensor
    fc2: torch.Tensor
    gated: bool

    @property
    def ffn_size(self) -> int:
        return self.fc2.shape[1]

    @property
    def gate(self) -> torch.Tensor:
        """GLU gate half of fc1 [F, H]."""
        return self.fc1[: self.ffn_size]

    @property
    def up(self) -> torch.Tensor:
        """GLU up half of fc1 [F, H] (all of fc1 for a plain MLP)."""
        return self.fc1[self.ffn_size:] if self.gated else self.fc1

    @classmethod
    def from_parts(cls, gate: torch.Tensor | None, up: torch.Tensor,
                   fc2: torch.Tensor) -> "MLPWeights":
        """Reassemble from a gate half (None for a plain MLP), the up half (or fc1) and fc2."""
        fc1 = up if gate is None else torch.cat([gate, up])
        return cls(fc1, fc2, gate is not None)

    def to(self, dtype: torch.dtype) -> "MLPWeights":
        return MLPWeights(self.fc1.to(dtype), self.fc2.to(dtype), self.gated)


def dense_mlp(fc1_FH: torch.Tensor, fc2_HF: torch.Tensor) -> MLPWeights:
    """Wrap a dense MLP's fc1/fc2; a GLU is recognised by fc1 having twice fc2's FFN rows."""
    if fc1_FH.dim() != 2 or fc2_HF.dim() != 2 or fc1_FH.shape[1] != fc2_HF.shape[0]:
        raise CheckpointError(f"dense MLP weights have shapes fc1 {tuple(fc1_FH.shape)}, fc2 "
                              f"{tuple(fc2_HF.shape)}; expected fc1 [F or 2F, H] and fc2 [H, F]")
    ffn = fc2_HF.shape[1]
    if fc1_FH.shape[0] not in (ffn, 2 * ffn):
        raise CheckpointError(f"fc1 has {fc1_FH.shape[0]} rows but fc2 has {ffn} columns; "
                              "expected F (plain MLP) or 2F (GLU)")
    return MLPWeights(fc1_FH, fc2_HF, gated=fc1_FH.shape[0] == 2 * ffn)


def shard(mlp: MLPWeights, index: int, granularity: int) -> MLPWeights:
    """Shard `index` of G (arXiv 2410.07524): intermediate neurons [index*S, (index+1)*S) of
    every matrix, S = F / G. The shards' outputs sum to the dense MLP's output."""
    if mlp.ffn_size % granularity:
        raise CheckpointError(f"dense FFN size {mlp.ffn_size} is not divisible by granularity="
                              f"{granularity}; pick a G that divides it")
    size = mlp.ffn_size // granularity
    rows = slice(index * size, (index + 1) * size)
    return MLPWeights.from_parts(mlp.gate[rows] if mlp.gated else None, mlp.up[rows],
                                 mlp.fc2[:, rows])


def expert_shard_index(expert: int, granularity: int) -> int:
    """Which dense shard expert `expert` holds: the shard list repeated E/G times."""
    return expert % granularity


def init_router(mode: str, num_experts: int, granularity: int, hidden: int, std: float,
                generator: torch.Generator) -> torch.Tensor:
    """Router weight [E, H] in fp32.

    virtual_group: E/G rows from N(0, std^2), each repeated G times in a row, so experts
    g*G .. g*G+G-1 (the G shards of copy g) get identical logits (arXiv 2410.07524).
    random: E independent rows. zero: all zeros.
    """
    if mode == "zero":
        return torch.zeros(num_experts, hidden)
    rows = num_experts // granularity if mode == "virtual_group" else num_experts
    weight = torch.randn(rows, hidden, generator=generator) * std
    return weight.repeat_interleave(num_experts // rows, dim=0)


def output_scale(num_experts: int, topk: int, granularity: int, score_function: str,
                 pre_softmax: bool) -> float:
    """Factor the routed experts' output must be multiplied by to match the dense MLP at init
    (arXiv 2410.07524).

    With gates renormalised over the K chosen experts (softmax after selection; sigmoid with
    K > 1), the K/G chosen copies share a total gate of 1 spread over K experts: scale G.
    With softmax before selection and a near-uniform router, each chosen expert gets about 1/E:
    scale E*G/K. Sigmoid with K = 1 gates by sigmoid(logit), about 1/2 at init: scale 2G.
    """
    if score_function == "softmax" and pre_softmax:
        return num_experts * granularity / topk
    if score_function == "sigmoid" and topk == 1:
        return 2.0 * granularity
    return float(granularity)


@dataclass(frozen=True)
class MatrixFactors:
    """Multipliers for the gate half, the up half (all of fc1 for a plain MLP) and fc2."""

    gate: float
    up: float
    fc2: float


def scale_factors(scale: float, gated: bool, activation: str, rule: str) -> MatrixFactors:
    """Split an output scale over the MLP's matrices.

    exact: only where the MLP is linear in the weight, so any activation is preserved exactly:
        GLU: scale^(1/2) on the up half and fc2; plain MLP: scale on fc2.
    paper (arXiv 2410.07524): scale^(1/3) on each of gate, up, fc2 for a GLU and on fc1 (which
        enters squared) and fc2 for squared ReLU; scale^(1/2) on fc1 and fc2 otherwise. Exact for
        ReLU, squared ReLU and ReGLU; approximate for SwiGLU and GELU.
    none: no scaling.
    """
    if rule == "none" or scale == 1.0:
        return MatrixFactors(1.0, 1.0, 1.0)
    if rule == "exact":
        if gated:
            return MatrixFactors(1.0, scale ** 0.5, scale ** 0.5)
        return MatrixFactors(1.0, 1.0, scale)
    if gated:
        cube = scale ** (1 / 3)
        return MatrixFactors(cube, cube, cube)
    if activation == "squared_relu":
        cube = scale ** (1 / 3)
        return MatrixFactors(1.0, cube, cube)
    root = scale ** 0.5
    return MatrixFactors(1.0, root, root)


def apply_factors(mlp: MLPWeights, factors: MatrixFactors) -> MLPWeights:
    """The MLP with each matrix multiplied by its factor."""
    return MLPWeights.from_parts(mlp.gate * factors.gate if mlp.gated else None,
                                 mlp.up * factors.up, mlp.fc2 * factors.fc2)
