"""A Megatron-Core GPT whose linears and norms are SIMoE-interpolated, with its prompt router.

`SIMoEGPTModel` is a `GPTModel` (so Megatron's DDP, optimizer, schedules and torch_dist
checkpoints see the model they know, under the same parameter names as the dense seed) built on
Megatron's local layer spec with every QKV, attention-output, fc1 and fc2 linear and every norm
(the final one included) replaced by its interpolated form (`megamoe.simoe.interpolated`).
Embeddings and the output layer stay frozen seed weights. Before each forward the prompt router
sets the per-sequence merging coefficients (SIMoE, arXiv 2506.12597) from the prompt's features:
by default the seed model's own final hidden states, from a forward pass of the frozen seed
(no gradient, no dropout), as SMAT's router reads its backbone's features. In training, the mask
regulariser (`penalties.MaskRegularizer`: sparsity Lagrangian + overlap) and SMAT's penalty on
the router's squared logits (`penalties.router_logit_penalty`) join the loss through
Megatron's `MoEAuxLossAutoScaler`, as Megatron's own auxiliary losses do, so each optimizer step
counts it once whatever the number of micro-batches; `after_step()` follows each optimizer step
(the Lagrangian's dual step, the router's temperature schedule).

Sequence parallelism is refused: the router pools the whole prompt, and the replicated gates would
need the layernorm-style gradient all-reduce Megatron gives only to norm weights.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megamoe.errors import ConfigError
from megamoe.megatron.linear_specs import local_block_spec_with
from megamoe.megatron.masks import attention_mask_for
from megamoe.simoe.config import SIMoEConfig
from megamoe.simoe.interpolated import (
    InterpolatedColumnParallelLinear,
    InterpolatedNorm,
    InterpolatedRowParallelLinear,
)
from megamoe.simoe.merge import MergeState, PromptRouter, pool_prompt
from megamoe.simoe.penalties import MaskRegularizer, router_logit_penalty

TRAINABLE_SUFFIXES = ("delta_weight", "mask_logits")
OWN_PREFIXES = ("simoe_router.", "simoe_regularizer.")


def is_simoe_state(name: str) -> bool:
    """Whether a state-dict entry is SIMoE's own (not in the dense seed's checkpoint)."""
    return name.endswith(TRAINABLE_SUFFIXES) or name.startswith(OWN_PREFIXES)


def simoe_block_spec(config: TransformerConfig, merge: MergeState, simoe: SIMoEConfig
                     ) -> TransformerBlockSubmodules:
    """Megatron's local GPT layer spec, every linear and norm interpolated, for all layers."""
    params = {"merge": merge, "simoe": simoe}
    return local_block_spec_with(
        config,
        column=ModuleSpec(module=InterpolatedColumnParallelLinear, params=params),
        row=ModuleSpec(module=InterpolatedRowParallelLinear, params=params),
        norm=ModuleSpec(module=InterpolatedNorm, params=params))


class SIMoEGPTModel(GPTModel):
    """GPTModel + SIMoE: `forward(..., prompt_mask=[B, S] bool)` routes the prompt first."""

    def __init__(self, config: TransformerConfig, simoe: SIMoEConfig, vocab_size: int,
                 max_sequence_length: int, **gpt_kwargs) -> None:
        if config.sequence_parallel:
            raise ConfigError("SIMoE does not support sequence_parallel=True: set it to false "
                              "(tensor parallelism without it is supported)")
        merge = MergeState()
        super().__init__(config=config,
                         transformer_layer_spec=simoe_block_spec(config, merge, simoe),
                         vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                         **gpt_kwargs)
        if simoe.router_input == "hidden" and not (self.pre_process and self.post_process):
            raise ConfigError("SIMoE's router reads the seed's final hidden states, which needs "
                              "the whole model on one pipeline stage: set parallel.pipeline=1 "
                              "or finetune.simoe.router_input=embeddings")
        self.merge = merge
        self.router_input = simoe.router_input
        self.router_logit_penalty = simoe.router_logit_penalty
        self.selection_weighted_sparsity = simoe.selection_weighted_sparsity
        if self.pre_process:
            self.simoe_router = PromptRouter(config.hidden_size, simoe)
        for name, param in self.named_parameters():
            param.requires_grad_(is_simoe_state(name))
        self.simoe_regularizer = MaskRegularizer(self, simoe)

    @torch.no_grad()
    def seed_hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                           attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """[B, S, H]: the frozen seed model's final hidden states (after the final norm), in
        inference mode (no dropout, no gate noise)."""
        captured = []

        def keep(_module, _inputs, output):
            captured.append(output[0] if isinstance(output, tuple) else output)

        hook = self.decoder.register_forward_hook(keep)
        was_training = self.training
        self.train(False)
        try:
            with self.merge.seed_pass():
                GPTModel.forward(self, input_ids, position_ids, attention_mask)
        finally:
            hook.remove()
            self.train(was_training)
        return captured[0].transpose(0, 1)

    def route(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor,
              position_ids: Optional[torch.Tensor] = None,
              attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """a_BM from the prompt tokens' features (`simoe.router_input`). Positions default to
        0..S-1, the attention mask to the causal mask."""
        return self.route_with_logits(input_ids, prompt_mask, position_ids, attention_mask)[0]

    def route_with_logits(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor,
                          position_ids: Optional[torch.Tensor] = None,
                          attention_mask: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a_BM, the router's logits [B, M]), as `route`."""
        if self.router_input == "embeddings":
            features_BSH = self.embedding.word_embeddings(input_ids)
        else:
            length = input_ids.shape[1]
            if position_ids is None:
                position_ids = torch.arange(length, device=input_ids.device).expand_as(input_ids)
            if attention_mask is None:
                attention_mask = attention_mask_for(length, input_ids.is_cuda)
            features_BSH = self.seed_hidden_states(input_ids, position_ids, attention_mask)
        pooled_BH = pool_prompt(features_BSH, prompt_mask)
        logits_BM = self.simoe_router.logits(pooled_BH)
        return self.simoe_router(pooled_BH, logits_BM), logits_BM

    def after_step(self) -> dict[str, float]:
        """After each optimizer step: the Lagrangian's dual step and the router's temperature
        schedule; their metrics."""
        metrics = self.simoe_regularizer.step()
        if self.pre_process:
            self.simoe_router.advance()
            metrics["simoe/router_temperature"] = self.simoe_router.temperature()
        return metrics

    def forward(self, input_ids, position_ids, attention_mask, *args,
                prompt_mask: Optional[torch.Tensor] = None,
                coefficients: Optional[torch.Tensor] = None, **kwargs):
        """As GPTModel.forward; the merge uses `coefficients` [B, M] if given, else the router's
        reading of `prompt_mask` (True on prompt tokens)."""
        router_logits = None
        if coefficients is None:
            if prompt_mask is None:
                raise ValueError("SIMoEGPTModel.forward needs prompt_mask (or coefficients)")
            coefficients, router_logits = self.route_with_logits(input_ids, prompt_mask,
                                                                 position_ids, attention_mask)
        self.merge.coefficients_BM = coefficients
        self.merge.router_logits_BM = router_logits
        output = super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        if self.training and torch.is_grad_enabled():
            output = MoEAuxLossAutoScaler.apply(output, self.auxiliary_loss())
        return output

    def auxiliary_loss(self) -> torch.Tensor:
        """What this forward adds to the LM loss: the mask regulariser (its sparsity terms
        weighted by the batch's mean coefficients with `simoe.selection_weighted_sparsity`) plus
        `simoe.router_logit_penalty` x the mean squared router logit (SMAT's two terms)."""
        selection_M = None
        if self.selection_weighted_sparsity:
            selection_M = self.merge.require().detach().float().mean(dim=0)
        loss = self.simoe_regularizer(selection_M)[0]
        logits_BM = self.merge.router_logits_BM
        if self.router_logit_penalty > 0 and logits_BM is not None:
            loss = loss + router_logit_penalty(logits_BM, self.router_logit_penalty)
        return loss
