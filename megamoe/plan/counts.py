"""A model's parameter counts by part, read off its meta-device build: the total, what one
token uses, and the parts that published figures count differently (input embedding, output
layer, multi-token-prediction block).

Every count is of the modules the trainer builds (`megamoe.train.model.build_chunks` at one
rank), so whatever the config adds (attention biases and sinks, expert and router biases, QK
norms per head or over the projection, multi-token-prediction depths) is counted as built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megamoe.plan.layouts import Layout
from megamoe.plan.shards import fake_rank, meta_transformer_config, on_meta
from megamoe.train.config import TrainConfig


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter elements of a whole model (one copy of every tensor), by part."""

    total: int
    """Every parameter, the multi-token-prediction block included; a tied output layer once."""
    embedding: int
    """The input embedding (token table; learned positions when the model has them)."""
    output: int
    """The output layer's own weight (0 when tied to the embedding)."""
    mtp: int
    """The multi-token-prediction block (DeepSeek-V3, arXiv 2412.19437 sec. 2.2): per depth the
    two input norms, the 2d x d projection, one transformer layer and its final norm; it
    shares the model's embedding and output layer, so they are not in it."""
    mtp_depths: int
    inactive: int
    """Routed-expert parameters of the main model a token does not use: each MoE layer's
    routed experts times 1 - topk / num_experts."""
    mtp_inactive: int
    """The same for the multi-token-prediction block's MoE layers."""

    @property
    def main(self) -> int:
        """The model without its multi-token-prediction block (what inference runs)."""
        return self.total - self.mtp

    @property
    def active(self) -> int:
        """Parameters of the main model one token uses: all but the routed experts it is not
        sent to; embedding and output layer whole."""
        return self.main - self.inactive

    @property
    def active_without_embedding(self) -> int:
        """`active` less the input embedding (a token reads one row of it; the output layer
        computes every logit)."""
        return self.active - self.embedding

    @property
    def active_without_embedding_and_output(self) -> int:
        """`active` less the input embedding and the output layer."""
        return self.active_without_embedding - self.output

    @property
    def mtp_active(self) -> int:
        """Parameters of the multi-token-prediction block one token uses."""
        return self.mtp - self.mtp_inactive

    @property
    def with_mtp_copies(self) -> int:
        """The total as DeepSeek-V3's checkpoint stores it: each multi-token-prediction depth
        with its own copy of the embedding and the output head (`model.layers.{N+k}.
        embed_tokens`, `shared_head.head`), which Megatron-Core shares instead."""
        return self.total + self.mtp_depths * (self.embedding + self.output)

    def as_dict(self) -> dict:
        """The parts and the derived counts, by name (the planner's JSON `parameters`)."""
        names = ("main", "active", "active_without_embedding",
                 "active_without_embedding_and_output", "mtp_active", "with_mtp_copies")
        return {**dataclasses.asdict(self), **{name: getattr(self, name) for name in names}}


def _elements(module: Optional[torch.nn.Module]) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _inactive(module: Optional[torch.nn.Module]) -> float:
    """Routed-expert elements of `module`'s MoE layers a token does not use (for routers
    without a fixed k, such as top-p or threshold routing, `moe.topk` stands for k; with
    zero-computation experts, the real experts per token of their budget)."""
    from megamoe.layer import MoELayer

    if module is None:
        return 0.0
    return sum(_elements(layer.experts)
               * (1 - layer.cfg.real_experts_per_token / layer.cfg.num_experts)
               for layer in module.modules() if isinstance(layer, MoELayer))


def model_counts(model: torch.nn.Module) -> ParameterCounts:
    """The counts of one GPTModel holding every layer (pre- and post-processing, one rank)."""
    mtp = getattr(model, "mtp", None)
    return ParameterCounts(
        total=_elements(model), embedding=_elements(getattr(model, "embedding", None)),
        output=_elements(getattr(model, "output_layer", None)), mtp=_elements(mtp),
        mtp_depths=0 if mtp is None else len(mtp.layers),
        inactive=round(_inactive(model.decoder)), mtp_inactive=round(_inactive(mtp)))


def parameter_counts(config: TrainConfig, vocab_size: int) -> ParameterCounts:
    """The counts of `config`'s whole model, built on the meta device at one rank."""
    from megamoe.train.model import build_chunks

    one = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, tensor=1, pipeline=1, virtual_stages=1, expert=1,
        first_stage_layers=None, last_stage_layers=None))
    with fake_rank(Layout(1), 0, config.training.seed):
        tc = meta_transformer_config(one, bf16=False)
        with on_meta():
            (model,) = build_chunks(one, tc, vocab_size)
        return model_counts(model)
