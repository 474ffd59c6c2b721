"""The multi-token-prediction layers' two-way table (DeepSeek-V3 tech report, arXiv 2412.19437,
sec. 2.2), shared by every architecture whose release stores them as DeepSeek-V3 does
(`num_nextn_predict_layers` layers after the decoder's: DeepSeek-V3, Kimi-K2, GLM-4.5).

Depth k (0-based) of a model of N decoder layers is Hugging Face layer N + k, and Megatron-Core's
MTP layer k (`megamoe.megatron.specs.mtp_block_spec`; the same checkpoint keys in 0.16 and 0.19):
- `model.layers.{N+k}.enorm.weight`, `hnorm.weight`, `eh_proj.weight` <-> `mtp.layers.{k}.enorm`,
  `hnorm`, `eh_proj` (its input is [enorm(embedding); hnorm(hidden)] on both sides);
- `shared_head.norm.weight` <-> `mtp.layers.{k}.final_layernorm.weight`;
- the layer's own decoder tensors (attention, norms, MoE) under the same prefix <->
  `mtp.layers.{k}.transformer_layer.*`, through the architecture's table of its last decoder
  layer (the kind the trainer gives an MTP layer);
- `embed_tokens.weight` and `shared_head.head.weight`: copies of the main embedding and output
  head, which Megatron-Core's MTP shares; the import checks they equal `model.embed_tokens.weight`
  and `lm_head.weight` (the embedding when the head is tied) and the export writes them again.
"""
from __future__ import annotations

from megamoe.checkpointing.hf.base import Architecture, Block, Rule, prefixed, same
from megamoe.checkpointing.hf_moe_arch import HFMoEModel
from megamoe.errors import CheckpointError

TRANSFORMER_LAYER = "transformer_layer."
"""Where an MTP layer's transformer layer lives among its checkpoint keys."""


def mtp_rules(model: HFMoEModel) -> list[Rule]:
    """One depth's own tensors (names relative to its layer on both sides)."""
    a = model.arch
    H, V = a.hidden_size, a.vocab_size
    head_hf, head_megatron = (("model.embed_tokens.weight", "embedding.word_embeddings.weight")
                              if a.tie_word_embeddings else
                              ("lm_head.weight", "output_layer.weight"))
    return [same("enorm.weight", "enorm.weight", (H,)),
            same("hnorm.weight", "hnorm.weight", (H,)),
            same("eh_proj.weight", "eh_proj.weight", (H, 2 * H)),
            same("shared_head.norm.weight", "final_layernorm.weight", (H,)),
            Rule("embedding.word_embeddings.weight", ("embed_tokens.weight",), ((V, H),),
                 copy_of="model.embed_tokens.weight"),
            Rule(head_megatron, ("shared_head.head.weight",), ((V, H),), copy_of=head_hf)]


def mtp_blocks(arch: Architecture, model: HFMoEModel, depths: int) -> list[Block]:
    """The blocks of `depths` multi-token-prediction layers of `model` (its table `arch`),
    after its decoder layers: `model.layers.{N+k}.` <-> `mtp.layers.{k}.`. `depths`: those the
    import finds in the files (`mtp_depths`), those the export finds in the checkpoint
    (`model.mtp_layers` of its training config)."""
    last = model.arch.num_layers - 1
    rules = tuple(mtp_rules(model) +
                  prefixed(arch.layer_rules(model, last), megatron=TRANSFORMER_LAYER))
    return [Block(f"model.layers.{last + 1 + k}.", f"mtp.layers.{k}.", rules,
                  is_moe=model.moe.pattern[last])
            for k in range(depths)]


def mtp_depths(model: HFMoEModel, layers: set[int], where: str) -> int:
    """How many multi-token-prediction layers the files hold, from the layer indices of their
    `model.layers.{i}.*` tensors: all those config.json announces (`num_nextn_predict_layers`,
    layers N..N+D-1), or none (transformers' DeepSeek-V3 and GLM-4.5 announce one and save
    none); anything else is refused in one line."""
    beyond = sorted(i for i in layers if i >= model.arch.num_layers)
    announced = list(range(model.arch.num_layers, model.arch.num_layers + model.mtp_layers))
    if beyond and beyond != announced:
        raise CheckpointError(
            f"{where} holds layers {beyond} beyond num_hidden_layers={model.arch.num_layers}, "
            f"but config.json's num_nextn_predict_layers={model.mtp_layers} announces "
            f"{announced or 'none'} (multi-token prediction); fix config.json, or pass "
            "--drop-mtp to import the model without them")
    return len(beyond)
