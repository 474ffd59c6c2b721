"""Dense -> MoE upcycling of Megatron-Core and Hugging Face checkpoints.

- `recipe`: UpcycleRecipe, every choice of a conversion.
- `granular`, `drop`, `experts`: the methods as pure tensor functions (sparse upcycling
  arXiv 2212.05055, granular upcycling with virtual groups arXiv 2410.07524, Drop-Upcycling
  arXiv 2502.19261).
- `moe_layer`, `convert`: the MoE checkpoint in Megatron-Core's layout, one layer at a time, read
  and written through `megamoe.checkpointing` (its readers and streaming DCP writer).
- `arch`, `verify`, `hf_logits`: dense against MoE logits, and transformers' logits against a
  megamoe checkpoint's (every converter's `--verify`).
"""
from megamoe.checkpointing.readers import open_dense_checkpoint
from megamoe.upcycle.convert import UpcycleResult, upcycle_checkpoint
from megamoe.upcycle.recipe import UpcycleRecipe, parse_moe_layers

__all__ = ["UpcycleRecipe", "UpcycleResult", "open_dense_checkpoint", "parse_moe_layers",
           "upcycle_checkpoint"]
